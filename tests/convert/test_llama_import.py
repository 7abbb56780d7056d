"""Llama-family import, proven by logits: the committed tiny random models (scripts/make_hf_fixtures.py) give
transformers' logits through longctx's model, in float32; bad folders give one-line errors. No torch here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.convert import core
from longctx.convert.cli import main
from longctx.convert.safetensors import Folder, Reader, write
from tests.convert import hf_tokenizers

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"


forward = nnx.jit(lambda model, ids: model(ids)[0])


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def imported_model(folder: Path):
    fam, cfg = core.hf_model_config(core.read_hf_config(folder))
    cfg = config_lib.validate(cfg)
    return cfg, nnx.merge(*core.load_params(fam, cfg, Folder(folder)))


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny", "gpt2_tiny"])
def test_logits_match_transformers(name):
    folder = FIXTURES / name
    ref = np.load(folder / "reference.npz")
    cfg, model = imported_model(folder)
    assert jnp.dtype(model.policy.compute) == jnp.float32
    assert rel_err(forward(model, jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4


def test_llama_fixture_exercises_the_options():
    cfg, _ = imported_model(FIXTURES / "llama_tiny")
    m = cfg.model
    assert (m.num_heads, m.num_kv_heads, m.mlp, m.norm, m.tie_embeddings) == (4, 2, "swiglu", "rmsnorm", False)
    cfg, _ = imported_model(FIXTURES / "qwen2_tiny")
    m = cfg.model
    assert (m.num_kv_heads, m.qkv_bias, m.out_bias, m.tie_embeddings, m.rope_theta) == (1, True, False, True, 1e6)


def test_import_writes_a_run_that_eval_restores(tmp_path, capsys):
    from longctx.runtime import Runner

    out = tmp_path / "run"
    assert main(["longctx-convert", "import", f"--hf_dir={FIXTURES / 'llama_tiny'}", f"--workdir={out}"]) == 0
    assert {"checkpoints", "config.json", "config.py", "tokenizer.json", "hf_config.json"} <= {
        p.name for p in out.iterdir()}
    runner = Runner.from_workdir(out)  # what longctx-eval and longctx-sample do
    assert runner.step == 0 and runner.cfg.data.tokenizer == "hf"
    ref = np.load(FIXTURES / "llama_tiny" / "reference.npz")
    assert rel_err(forward(runner.model(), jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4
    # the saved config file reproduces the run's config (longctx-train --config=OUT/config.py resumes)
    from longctx import config_files

    assert json.loads(config_lib.validate(config_files.load(str(out / "config.py"))).to_json()) == json.loads(
        runner.cfg.to_json())
    # the checkpoint holds an optimizer state for the resume
    from longctx.train import checkpoint

    mngr = checkpoint.manager(out, create=False)
    assert set(checkpoint.read_meta(mngr, 0)["crc32"]) == {"params", "nongrad", "opt_state"}
    mngr.close()


def _copy_fixture(tmp_path, edit=None, config_edit=None, name="llama_tiny") -> Path:
    """A fixture copied, its tensors passed through ``edit(dict) -> dict``, with a tokenizer.json whose ids fit
    the source's vocabulary (the fixture's own where it has one)."""
    src, dst = FIXTURES / name, tmp_path / "hf"
    dst.mkdir(parents=True)
    hf = json.loads((src / "config.json").read_text())
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
    else:
        hf_tokenizers.write_tokenizer(dst / "tokenizer.json", hf["vocab_size"],
                                      mask_at=-1 if hf["model_type"] in hf_tokenizers.ENCODER_TYPES else None)
    if config_edit:
        config_edit(hf)
    (dst / "config.json").write_text(json.dumps(hf))
    r = Reader(src / "model.safetensors")
    tensors = {n: np.array(r.get(n)) for n in r.names()}
    if edit:
        tensors = edit(tensors)
    write(dst / "model.safetensors", [(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()])
    return dst


def _error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main(["longctx-convert", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_one_line_errors(tmp_path, capsys):
    out = f"--workdir={tmp_path / 'out'}"
    assert "does not exist" in _error(capsys, "import", f"--hf_dir={tmp_path / 'nowhere'}", out)

    def unknown(hf):
        hf["model_type"] = "mamba"

    err = _error(capsys, "import", f"--hf_dir={_copy_fixture(tmp_path / 'a', config_edit=unknown)}", out)
    assert "model_type 'mamba' is not supported" in err and "llama" in err

    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        return t

    err = _error(capsys, "import", f"--hf_dir={_copy_fixture(tmp_path / 'b', drop)}", out)
    assert "model.layers.1.mlp.up_proj.weight is missing" in err

    def reshape(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
        return t

    err = _error(capsys, "import", f"--hf_dir={_copy_fixture(tmp_path / 'c', reshape)}", out)
    assert "model.layers.0.self_attn.k_proj.weight has shape [8, 32]" in err and "implies [16, 32]" in err
    assert not (tmp_path / "out").exists()  # nothing written on bad input
    assert "unknown command" in _error(capsys, "convert", "--hf_dir=x", out)
    assert "needs --hf_dir" in _error(capsys, "import", out)


def test_dry_run_and_sharded_folder(tmp_path, capsys):
    """A folder sharded with model.safetensors.index.json imports as the single file does; --dry_run writes
    nothing."""
    src, dst = FIXTURES / "llama_tiny", tmp_path / "sharded"
    dst.mkdir()
    for file in ("config.json", "tokenizer.json"):
        shutil.copyfile(src / file, dst / file)
    r = Reader(src / "model.safetensors")
    names = r.names()
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        write(dst / file, [(n, r.shape(n), r.dtype(n), lambda n=n: r.get(n)) for n in part])
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    assert main(["longctx-convert", "import", f"--hf_dir={dst}", f"--workdir={tmp_path / 'out'}", "--dry_run"]) == 0
    assert "all present" in capsys.readouterr().out and not (tmp_path / "out").exists()
    ref = np.load(src / "reference.npz")
    _, model = imported_model(dst)
    assert rel_err(forward(model, jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4


def test_safetensors_round_trip(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
               "c": rng.integers(0, 9, (2, 2, 2)).astype(np.int64), "d": np.zeros((0, 4), np.float16)}
    write(tmp_path / "t.safetensors", [(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()],
          metadata={"format": "pt"})
    raw = (tmp_path / "t.safetensors").read_bytes()
    assert int.from_bytes(raw[:8], "little") % 8 == 0
    r = Reader(tmp_path / "t.safetensors")
    assert r.metadata == {"format": "pt"} and r.names() == list(tensors)
    for n, a in tensors.items():
        assert r.get(n).dtype == a.dtype and np.array_equal(r.get(n), a)
    (tmp_path / "cut.safetensors").write_bytes(raw[:-4])
    with pytest.raises(Exception, match="truncated or corrupt"):
        Reader(tmp_path / "cut.safetensors")


def test_bfloat16_tensors_import_into_float32_parameters(tmp_path):
    def to_bf16(t):
        import ml_dtypes

        return {n: a.astype(ml_dtypes.bfloat16) for n, a in t.items()}

    folder = _copy_fixture(tmp_path, to_bf16)
    _, model = imported_model(folder)
    src = Reader(folder / "model.safetensors")
    want = np.asarray(src.get("model.layers.1.self_attn.o_proj.weight"), np.float32).T
    got = model.blocks[1].out.kernel[...]
    assert got.dtype == jnp.float32 and np.array_equal(np.asarray(got), want)


def test_rope_theta_flag(tmp_path, capsys):
    """--rope_theta sets the run's rotary base (context extension); refused for learned positions."""
    out = tmp_path / "run"
    assert main(["longctx-convert", "import", f"--hf_dir={FIXTURES / 'llama_tiny'}", f"--workdir={out}",
                 "--rope_theta=500000", "--nooptimizer_state"]) == 0
    assert "rotary base 10000 -> 500000" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model"]["rope_theta"] == 500000.0
    err = _error(capsys, "import", f"--hf_dir={FIXTURES / 'gpt2_tiny'}", f"--workdir={tmp_path / 'g'}",
                 "--rope_theta=500000")
    assert "learned positions, no rotary base" in err


def test_gpt2_original_names_and_buffers(tmp_path):
    """The original GPT-2 checkpoints name their tensors without the ``transformer.`` prefix and keep the
    causal-mask buffers (``h.N.attn.bias``): both read."""
    def original(t):
        t = {n.removeprefix("transformer."): a for n, a in t.items()}
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
        return t

    folder = _copy_fixture(tmp_path, original, name="gpt2_tiny")
    ref = np.load(FIXTURES / "gpt2_tiny" / "reference.npz")
    _, model = imported_model(folder)
    assert rel_err(forward(model, jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4


def test_mistral_reads_as_llama_with_a_note_on_its_window(tmp_path, capsys):
    def mistral(hf):
        hf.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096)
        hf.pop("attention_bias"), hf.pop("mlp_bias")

    folder = _copy_fixture(tmp_path, config_edit=mistral)
    assert main(["longctx-convert", "import", f"--hf_dir={folder}", f"--workdir={tmp_path / 'out'}", "--dry_run"]) == 0
    assert "sliding_window=4096" in capsys.readouterr().out
    ref = np.load(FIXTURES / "llama_tiny" / "reference.npz")
    _, model = imported_model(folder)
    assert rel_err(forward(model, jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4
