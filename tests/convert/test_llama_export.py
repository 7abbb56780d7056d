"""Export: a Llama-family run written as a Hugging Face folder; export then import is bit-identical, and
transformers (where installed) computes the fixture's logits from the exported folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.convert import core
from longctx.convert.cli import main
from longctx.convert.safetensors import Folder, Reader
from tests.convert import hf_tokenizers

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"


def _params(folder: Path) -> dict:
    fam, cfg = core.hf_model_config(core.read_hf_config(folder))
    _, params, _, _ = core.load_params(fam, config_lib.validate(cfg), Folder(folder))
    return nnx.to_pure_dict(params)


def import_then_export(name: str, tmp: Path) -> Path:
    """The fixture ``name`` imported into a run under ``tmp`` and exported by the command; the exported folder."""
    run, out = tmp / "run", tmp / "hf"
    src = hf_tokenizers.with_tokenizer(name, tmp / "src")  # the tokenizer's ids fit the model (the import's rule)
    core.import_hf(src, run, optimizer_state=False, log=lambda *_: None)
    assert main(["longctx-convert", "export", f"--workdir={run}", f"--hf_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module", params=["llama_tiny", "qwen2_tiny", "gpt2_tiny"])
def exported(request, tmp_path_factory):
    return request.param, import_then_export(request.param, tmp_path_factory.mktemp(request.param))


def test_export_then_import_is_bit_identical(exported):
    name, out = exported
    src = Reader(FIXTURES / name / "model.safetensors")
    back = Reader(out / "model.safetensors")
    assert sorted(back.names()) == sorted(n for n in src.names())
    for n in src.names():  # the very tensors of the source folder, bit for bit
        assert back.dtype(n) == src.dtype(n) and np.array_equal(back.get(n), src.get(n)), n
    a, b = _params(FIXTURES / name), _params(out)
    leaves = zip(*(sorted(nnx.traversals.flatten_mapping(t).items()) for t in (a, b)))
    for (pa, xa), (pb, xb) in leaves:
        assert pa == pb and np.array_equal(np.asarray(xa), np.asarray(xb)), pa
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((FIXTURES / name / "config.json").read_text())
    # not the model's: the initialisation's scale; the context, which export sets to the longer of the source's
    # and the run's train.seq_len (a run trained at a longer context exports that)
    # and GPT-2's training dropout, which the import leaves out (model.dropout=0)
    shared = {k for k in set(cfg) & set(src_cfg) if not k.endswith("_pdrop")} - {"initializer_range",
                                                                               "max_position_embeddings"}
    assert cfg.get("max_position_embeddings", 256) == max(256, src_cfg.get("max_position_embeddings", 0))
    assert {"model_type", "architectures", "vocab_size", "tie_word_embeddings"} <= shared
    assert {k: cfg[k] for k in shared} == {k: src_cfg[k] for k in shared}
    assert (out / "tokenizer.json").is_file()  # the run's, copied


LOAD = """
import sys, numpy as np, torch, transformers
auto = getattr(transformers, sys.argv[3])
model = auto.from_pretrained(sys.argv[1], attn_implementation="eager").float().eval()
ref = np.load(sys.argv[2])
with torch.no_grad():
    logits = model(torch.from_numpy(ref["ids"]).long()).logits.numpy()
print(float(np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()))
"""


def transformers_rel_err(out: Path, name: str, auto: str = "AutoModelForCausalLM") -> float:
    """The relative error of the logits transformers (its class ``auto``) computes from the folder ``out`` against
    the fixture ``name``'s: in this interpreter where transformers and torch are installed, else in the one named by
    $LONGCTX_HF_PYTHON (e.g. the environment scripts/make_hf_fixtures.py runs in); skips the test without either."""
    import importlib.util
    import os
    import subprocess
    import sys

    python = sys.executable if all(importlib.util.find_spec(m) for m in ("transformers", "torch")) else \
        os.environ.get("LONGCTX_HF_PYTHON")
    if not python:
        pytest.skip("transformers and torch are not installed (not dependencies of longctx); set "
                    "LONGCTX_HF_PYTHON to a Python that has them")
    run = subprocess.run([python, "-c", LOAD, str(out), str(FIXTURES / name / "reference.npz"), auto],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout.strip().splitlines()[-1])


def test_transformers_loads_the_export(exported):
    """transformers loads the exported folder and computes the fixture's logits."""
    name, out = exported
    assert transformers_rel_err(out, name) <= 1e-5


def test_scanned_layers_import_and_export(tmp_path):
    """A run with model.scan_layers='on' (stacked blocks) imports and exports the same tensors."""
    cfg = config_lib.base_config()
    cfg.model.scan_layers = "on"
    run, out = tmp_path / "run", tmp_path / "hf"
    core.import_hf(FIXTURES / "llama_tiny", run, config=cfg, optimizer_state=False, log=lambda *_: None)
    assert config_lib.merge_over_base(json.loads((run / "config.json").read_text())).model.scan_layers == "on"
    core.export_hf(run, out, log=lambda *_: None)
    src, back = Reader(FIXTURES / "llama_tiny" / "model.safetensors"), Reader(out / "model.safetensors")
    assert sorted(back.names()) == sorted(src.names())
    assert all(np.array_equal(back.get(n), src.get(n)) for n in src.names())


def test_export_refuses_a_model_outside_the_families(tmp_path, capsys):
    from longctx.models.decoder import build_model
    from longctx.train.step import split_model

    cfg = config_lib.base_config()
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.head_dim, m.d_ff = 16, 8, 1, 2, 4, 8
    cfg = config_lib.validate(cfg)
    _, params, nongrad, _ = split_model(build_model(cfg.model))
    core.save_checkpoint(tmp_path / "run", {"params": params, "nongrad": nongrad}, cfg)
    with pytest.raises(SystemExit) as e:
        main(["longctx-convert", "export", f"--workdir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert "no family" in err and "model.norm='layernorm'" in err
    assert not (tmp_path / "hf").exists()


def test_export_of_a_run_with_longctx_s_own_tokenizer_says_it_writes_none(tmp_path):
    """A run trained from scratch (bytes, BPE, words...) has no Hugging Face tokenizer: the export says so in one
    line instead of leaving a folder transformers cannot tokenize for without a word."""
    from longctx.models.decoder import build_model
    from longctx.train.step import split_model

    cfg = config_lib.base_config()
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.head_dim, m.d_ff = 256, 8, 1, 2, 4, 8
    m.norm, m.mlp, m.positions, m.tie_embeddings = "rmsnorm", "swiglu", "rotary", False
    cfg = config_lib.validate(cfg)
    _, params, nongrad, _ = split_model(build_model(cfg.model))
    core.save_checkpoint(tmp_path / "run", {"params": params, "nongrad": nongrad}, cfg)
    lines = []
    core.export_hf(tmp_path / "run", tmp_path / "hf", log=lines.append)
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert lines[-1].startswith("note: no tokenizer.json written: the run's data.tokenizer='bytes'"), lines
