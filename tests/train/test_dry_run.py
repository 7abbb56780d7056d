"""longctx-train --dry_run compiles the train step for the mesh and reports memory and FLOPs
without touching data."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import tiny_config, xla_flags


def test_plan_reports_memory_and_flops_without_data(tmp_path):
    from longctx.train import dry_run

    cfg = tiny_config(tmp_path / "no-such-corpus", tmp_path / "no-cache")
    res = dry_run.plan(cfg)
    assert res["devices"] == 1 and res["parameters"] > 0
    assert res["argument_bytes"] >= 4 * res["parameters"]  # fp32 params alone
    assert res["temp_bytes"] > 0 and res["flops_per_step"] > 0
    assert not (tmp_path / "no-cache").exists()
    assert "MiB" in dry_run.report(res)


def test_dry_run_cli_on_eight_devices_shards_the_arguments(tmp_path):
    code = textwrap.dedent(f"""
        from longctx.config import base_config
        from longctx.train import dry_run
        from tests.conftest import tiny_config
        from pathlib import Path
        one = dry_run.plan(tiny_config(Path({str(tmp_path)!r}) / "x", Path({str(tmp_path)!r}) / "c", batch_size=8))
        cfg = tiny_config(Path({str(tmp_path)!r}) / "x", Path({str(tmp_path)!r}) / "c", batch_size=8)
        cfg.mesh.data, cfg.mesh.fsdp = 2, 4
        eight = dry_run.plan(cfg)
        print("RATIO", one["argument_bytes"] / eight["argument_bytes"])
    """)
    env = {**os.environ, "XLA_FLAGS": xla_flags(8),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert "RATIO" in r.stdout, r.stderr[-3000:]
    ratio = float(r.stdout.split("RATIO")[1].split()[0])
    assert ratio > 2.0, ratio  # parameters and optimizer state split 4 ways by fsdp (the batch 8 ways)


def _tiny_flops_config(tmp_path, **model):
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path / "no-such-corpus", tmp_path / "no-cache")
    cfg.model.vocab_size = 256
    for k, v in model.items():
        cfg.model[k] = v
    return cfg


def test_training_flops_per_token_is_three_forward_matmul_passes(tmp_path):
    """plan()'s FLOPs per token = 3 x step_bench.forward_matmul_flops (the bench's jaxpr count of the loss
    over a step's rows, on concrete parameters) / tokens; stacking the layers into a scan changes nothing."""
    from longctx import config as config_lib
    from longctx.bench import step_bench
    from longctx.models.decoder import build_model
    from longctx.train import dry_run
    from longctx.train.step import split_model

    cfg = config_lib.validate(_tiny_flops_config(tmp_path))
    graphdef, params, nongrad, rest = split_model(build_model(cfg.model, seed=0, execution=cfg.execution))
    bench = step_bench.forward_matmul_flops(cfg, graphdef, params, nongrad, rest)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    res = dry_run.plan(_tiny_flops_config(tmp_path, scan_layers="off"))
    assert res["training_flops_per_token"] > 0
    assert abs(res["training_flops_per_token"] - 3 * bench["flops"] / tokens) <= 1e-9 * res["training_flops_per_token"]
    assert "training FLOPs per token (3 x forward matmuls)" in dry_run.report(res)
    scanned = dry_run.plan(_tiny_flops_config(tmp_path, scan_layers="on"))
    assert (res["scan_layers"], scanned["scan_layers"]) == ("off", "on")
    assert scanned["training_flops_per_token"] == res["training_flops_per_token"]


def test_training_flops_per_token_with_windows_carrying_state(tmp_path):
    """Windows with a carried state: one window traced with the state, times the windows per row; the
    per-token figure matches the bench's count on concrete parameters over one row (the VQ codebook's own
    matmuls do not grow with the rows, so the figure is the one-row count)."""
    from longctx import config as config_lib
    from longctx.bench import step_bench
    from longctx.models.decoder import build_model
    from longctx.train import dry_run
    from longctx.train.step import split_model

    def windowed():
        c = _tiny_flops_config(tmp_path, block="gau", num_heads=1, norm="rmsnorm", positions="none")
        c.model.attention.name = "transformer_vq"
        c.model.attention.transformer_vq.codebook_size = 8
        c.model.attention.transformer_vq.block_len = 8
        c.train.window = 16
        c.train.batch_size = 1
        c.data.packing = "document"  # unpacked rows, as the bench's forward counts them
        return c

    cfg = config_lib.validate(windowed())
    graphdef, params, nongrad, rest = split_model(build_model(cfg.model, seed=0, execution=cfg.execution))
    bench = step_bench.forward_matmul_flops(cfg, graphdef, params, nongrad, rest)
    assert bench["windows"] == 2
    res = dry_run.training_flops_per_token(cfg, graphdef, params, nongrad, rest)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    assert res["training_flops_per_token"] > 0
    assert abs(res["training_flops_per_token"] - 3 * bench["flops"] / tokens) <= 1e-9 * res["training_flops_per_token"]


def test_plan_of_an_imported_encoder_takes_its_tokenizers_mask_token(tmp_path):
    """A freshly imported encoder (its table is its tokenizer's vocabulary, no id beyond it) plans with the
    tokenizer's own [MASK], read from the tokenizer file as the training task reads it, and compiles the
    masked-LM step."""
    import tokenizers

    from longctx.train import dry_run

    V = 120
    special = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}  # BERT's: [MASK] mid-vocabulary
    vocab = {**special, **{f"w{i}": i for i in range(V) if i not in special.values()}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(list(special))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = tiny_config(tmp_path / "no-such-corpus", tmp_path / "no-cache")
    cfg.model.kind, cfg.model.causal, cfg.model.vocab_size = "encoder", False, V
    cfg.data.tokenizer, cfg.data.options.tokenizer_file = "hf", str(tmp_path / "tokenizer.json")
    res = dry_run.plan(cfg)
    assert (res["mask_id"], res["vocab_size"]) == (103, V)
    assert res["flops_per_step"] > 0 and res["training_flops_per_token"] > 0
    assert not (tmp_path / "no-cache").exists()


def test_plan_of_a_packed_decoder_compiles_the_step_that_takes_segment_ids(tmp_path):
    """data.packing='segments': the trainer's step takes {'tokens', 'segment_ids', 'positions'} [B, T + 1]
    (longctx.train.tasks.LanguageModel), so the plan compiles that step: beside the parameters and the optimizer
    state its arguments hold three int32 arrays of [B, T + 1] (the unpacked step: the tokens alone)."""
    from longctx.train import dry_run

    cfg = tiny_config(tmp_path / "no-such-corpus", tmp_path / "no-cache", batch_size=2)
    cfg.model.num_layers, cfg.model.vocab_size, cfg.data.packing = 1, 256, "segments"
    res = dry_run.plan(cfg)
    rows = 2 * (cfg.train.seq_len + 1) * 4  # one int32 [B, T + 1] array
    batch = res["argument_bytes"] - res["param_bytes"] - res["opt_state_bytes"] - res["nongrad_bytes"]
    assert res["packed"] and 3 * rows <= batch < 4 * rows, (batch, rows)
    assert res["training_flops_per_token"] > 0 and res["flops_per_step"] > 0
    assert "packed documents" in dry_run.report(res)
    assert not (tmp_path / "no-cache").exists()


def test_plan_resolves_auto_packing_as_the_run_will(tmp_path):
    """data.packing='auto' on a `files` corpus: before the data is prepared the plan is packed and says the run
    decides once it is; once prepared, the train split's documents decide as the training task decides
    (config.resolve_packing): one document -> unpacked rows, three -> packed."""
    from longctx.data.prepare import prepare
    from longctx.train import dry_run

    def corpus(name, docs):
        root = tmp_path / name
        for split, n in (("train", docs), ("valid", 1)):
            (root / split).mkdir(parents=True)
            for i in range(n):
                (root / split / f"{i}.txt").write_text(f"document {i} of {split} " * 40)
        return root

    for name, docs, want in (("one", 1, False), ("three", 3, True)):
        cfg = tiny_config(corpus(name, docs), tmp_path / f"cache-{name}", batch_size=2)
        cfg.data.source, cfg.model.num_layers = "files", 1
        assert cfg.data.packing == "auto"
        before = dry_run.plan(cfg)
        assert before["packed"] and "not prepared yet" in before["packing_line"], before["packing_line"]
        prepare(cfg.data, ["train"], progress=False)
        res = dry_run.plan(cfg)
        assert res["packed"] is want, res["packing_line"]
        assert res["packing_line"].startswith(f"data.packing='auto' -> {'segments' if want else 'document'!r}")
        assert ("3 documents" in res["packing_line"]) if want else ("one document" in res["packing_line"])
        assert res["packing_line"] in dry_run.report(res)


def test_plan_of_a_bpe_config_needs_no_vocab_size(tmp_path):
    """data.tokenizer='bpe' has data.options.vocab_size ids whatever the corpus, so the plan of the main job's
    config needs no --config.model.vocab_size and neither reads the corpus nor trains the BPE."""
    from longctx.train import dry_run

    cfg = tiny_config(tmp_path / "no-such-corpus", tmp_path / "no-cache", batch_size=2)
    cfg.model.num_layers, cfg.data.tokenizer, cfg.data.options.vocab_size = 1, "bpe", 300
    res = dry_run.plan(cfg)
    assert res["vocab_size"] == 300
    assert not (tmp_path / "no-cache").exists()


def test_a_method_exact_at_the_run_length_is_noted(tmp_path):
    """A run whose rows a method computes exactly (``exact_len``: KDEformer's exact window of 2 chunks of 16)
    says so in one line, in the dry run as in the trainer's start; rows past it, exact methods and methods
    that approximate at every length say nothing."""
    from longctx import config as config_lib
    from longctx.train import dry_run

    def cfg_for(name, seq_len, **method):
        cfg = tiny_config(tmp_path / "no-such-corpus", tmp_path / "no-cache", seq_len=seq_len)
        cfg.model.attention.name, cfg.model.num_layers = name, 1
        cfg.model.attention[name] = method
        return cfg

    kde = {"causal": {"chunk_size": 16, "local_chunks": 2, "heavy_capacity": 4, "num_samples": 8}}
    res = dry_run.plan(cfg_for("kdeformer", 32, **kde))
    assert res["exact_notes"] == ["note: kdeformer computes exact softmax attention on rows of up to 32 tokens and "
                                  "this run trains on rows of 32: its approximation is not trained (only longer "
                                  "evaluation streams run it); train.seq_len > 32 trains it"]
    assert res["exact_notes"][0] in dry_run.report(res)
    for name, seq_len, method in (("kdeformer", 64, kde), ("swa", 32, {"window": 32}), ("dense", 32, {}),
                                  ("eva", 32, {"window_size": 16, "chunk_size": 4})):
        assert config_lib.exact_attention_notes(config_lib.validate(cfg_for(name, seq_len, **method))) == [], name
