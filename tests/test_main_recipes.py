"""scripts/main_recipes.py: a run's config, context table and training records become one row of the recipe table;
a table that did not score the main job's bytes is refused."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("main_recipes", ROOT / "scripts" / "main_recipes.py")
main_recipes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(main_recipes)


def _run(tmp_path, scored=262144):
    wd = tmp_path / "run"
    (wd / "eval").mkdir(parents=True)
    cfg = {"model": {"attention": {"name": "transformer_vq", "pattern": []}, "block": "gau", "d_model": 64,
                     "num_layers": 2, "vocab_size": 4096},
           "train": {"steps": 20, "batch_size": 8, "seq_len": 1024, "window": 256, "lr": 0.003},
           "data": {"tokenizer": "bpe", "packing": "document"}}
    (wd / "config.json").write_text(json.dumps(cfg))
    rows = [{"row_bytes": None, "bits_per_byte": 1.5, "bytes_scored": scored},
            {"row_bytes": 4096, "bits_per_byte": 1.4, "bytes_scored": scored}]
    (wd / "eval" / "test_step20_context.json").write_text(json.dumps(
        {"step": 20, "rows": rows, "compressors_bits_per_byte": {"xz-9e": 1.39, "gzip-9": 1.58}}))
    (wd / "eval" / "test_step8_context.json").write_text(json.dumps({"step": 8, "rows": [], "compressors_bits_per_byte": {}}))
    recs = [{"step": 10, "split": "train", "step_time": 2.0, "tokens_per_sec": 100.0},
            {"step": 20, "split": "train", "step_time": 1.0, "tokens_per_sec": 200.0},
            {"step": 20, "split": "valid", "bits_per_token": 3.0}]
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return wd


def test_a_run_becomes_a_row(tmp_path):
    row = main_recipes.record("r", _run(tmp_path), "longctx-train --config=configs/main.py", note="n")
    assert row["step"] == 20 and row["carried"] == 1.5 and row["resets"] == {"4096": 1.4}  # the newest table
    assert row["train_seconds"] == 30.0 and row["tokens_per_s"] == 200.0
    text = main_recipes.table([row])
    assert "| r (n) | bpe 4,096 | transformer_vq gau d64 x2 | 20 x 8 x 256 (1,024) |" in text
    assert "**1.5000** | 1.4000 | 1.3900 / 1.5800 | `longctx-train --config=configs/main.py` |" in text


def test_a_table_of_other_bytes_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="scored 1,000 bytes"):
        main_recipes.record("r", _run(tmp_path, scored=1000), "x")
