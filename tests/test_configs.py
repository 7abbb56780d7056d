"""Every shipped experiment config loads and validates."""

import runpy
from pathlib import Path

import pytest

from longctx.config import resolve_vocab, validate

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.py") if not p.name.startswith("_") and p.name != "base.py")
VOCAB = {"bytes": 256, "words": 267_735, "sentencepiece": 32_000}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_validates(path):
    cfg = runpy.run_path(str(path))["get_config"]()
    resolved = resolve_vocab(validate(cfg), VOCAB[cfg.data.tokenizer])
    assert resolved.train.seq_len % resolved.train.window == 0
