"""``longctx-convert import --plan``: the memory plan of training an import, from config.json alone (no tensor is
read), by compiling the run's train step for the config's mesh (longctx.train.dry_run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from longctx.convert import core
from longctx.convert.cli import main
from longctx.convert.safetensors import Folder
from tests.conftest import xla_flags

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama_tiny"

# Llama-2-7B's config.json (meta-llama/Llama-2-7b-hf), without its tensors
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
             "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
             "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
             "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32000}


def test_plan_reads_only_config_json(tmp_path, capsys):
    """A folder holding only the tiny fixture's config.json plans; the plan counts the fixture's parameters and
    reports the per-device split and the sharding; an import of the same folder is refused (no tensors)."""
    only = tmp_path / "cfg_only"
    only.mkdir()
    shutil.copyfile(FIXTURE / "config.json", only / "config.json")
    assert main(["longctx-convert", "import", f"--hf_dir={only}", "--plan", "--noprogress",
                 "--config=configs/pretrained/llama_long.py:tiny"]) == 0
    out = capsys.readouterr().out
    for part in ("per device (XLA memory analysis", "optimizer state", "temporaries", "parameter sharding"):
        assert part in out, out
    res = core.plan_hf(only, config="configs/pretrained/llama_long.py:tiny", log=lambda *_: None)
    folder = Folder(FIXTURE)
    assert res["parameters"] == sum(int(np.prod(folder.shape(n))) for n in folder.names())
    assert res["param_bytes"] == 4 * res["parameters"]  # float32 master weights, one device
    assert res["opt_state_bytes"] >= 2 * res["param_bytes"]  # Adam's two moments
    assert res["argument_bytes"] >= res["param_bytes"] + res["opt_state_bytes"]
    with pytest.raises(SystemExit) as e:
        main(["longctx-convert", "import", f"--hf_dir={only}", f"--workdir={tmp_path / 'run'}", "--noprogress"])
    assert e.value.code == 2 and "no *.safetensors file" in capsys.readouterr().err


@pytest.mark.slow
def test_llama2_7b_fits_70_gib_per_device_under_fsdp_on_8_devices(tmp_path):
    """The docs' launch (docs/pretrained.md, "Plan the memory"): Llama-2-7B's shape, fsdp over 8 simulated devices,
    rows of 4,096 tokens, batch 8, bfloat16 compute, per-block remat: the compiled step's peak is under 70 GiB per
    device, the parameters and the optimizer state are split 8 ways."""
    folder = tmp_path / "llama2_7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA2_7B))
    code = ("import json, sys; from longctx import config_files; from longctx.convert import core; "
            "c = config_files.load('configs/pretrained/llama_long.py'); c.model.dtype = 'bfloat16'; "
            "c.mesh.data, c.mesh.fsdp = 1, 8; c.train.seq_len, c.train.batch_size = 4096, 8; "
            "print('PLAN', json.dumps(core.plan_hf(sys.argv[1], config=c)))")
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=900,
                       env=env, cwd=ROOT)
    assert "PLAN" in r.stdout, r.stderr[-3000:]
    print(r.stdout)
    res = json.loads(r.stdout.split("PLAN", 1)[1])
    GiB = 1 << 30
    assert res["devices"] == 8 and res["mesh"]["fsdp"] == 8
    assert res["parameters"] == 6_738_415_616  # Llama-2-7B's published count: the architecture config.json implies
    whole = 4 * res["parameters"]
    assert whole / 8 <= res["param_bytes"] <= 1.001 * whole / 8  # every matrix split 8 ways, the norms replicated
    assert 2 * whole / 8 <= res["opt_state_bytes"] <= 1.001 * 2 * whole / 8
    assert res["temp_bytes"] > 0
    assert res["peak_bytes_estimate"] < 70 * GiB, res["peak_bytes_estimate"] / GiB
    assert "('fsdp', None)" in r.stdout and "peak (est.)" in r.stdout


def test_plan_of_an_encoder_reads_its_tokenizers_mask_token(tmp_path):
    """A folder with config.json and a tokenizer.json whose last id is its own mask token plans with that id, as the
    import does (without reading the tokenizer, the plan puts the mask one id beyond the model's vocabulary)."""
    tokenizers = pytest.importorskip("tokenizers")
    src = ROOT / "tests" / "fixtures" / "hf" / "roberta_tiny"
    folder = tmp_path / "roberta_cfg_only"
    folder.mkdir()
    shutil.copyfile(src / "config.json", folder / "config.json")
    V = json.loads((src / "config.json").read_text())["vocab_size"]
    vocab = {**{f"t{i}": i for i in range(V - 2)}, "</s>": V - 2, "<mask>": V - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.add_special_tokens(["</s>", "<mask>"])
    tok.save(str(folder / "tokenizer.json"))
    res = core.plan_hf(folder, config="configs/pretrained/roberta_to_vcc.py:tiny", log=lambda *_: None)
    assert res["vocab_size"] == V and res["mask_id"] == V - 1
