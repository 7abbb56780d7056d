"""Word-level ``tokenizer.json`` files that fit the committed tiny fixtures (tests/fixtures/hf/), whose folders
mostly have none: an import refuses a tokenizer whose ids do not fit the model's vocabulary (the default bytes
tokenizer's 256 ids do not fit a 96-id fixture), so a test that imports such a fixture gives its copy one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
ENCODER_TYPES = ("bert", "roberta")


def write_tokenizer(path: Path, vocab_size: int, mask_at: int | None = -1) -> Path:
    """A word-level tokenizer.json of ``vocab_size`` ids: RoBERTa's specials (``<s>`` ``<pad>`` ``</s>`` ``<unk>``),
    ``<mask>`` at ``mask_at`` (-1: the last id, RoBERTa's place; None: no mask token), the words ``w0``, ``w1``, ...
    in the other ids."""
    tokenizers = pytest.importorskip("tokenizers")
    specials = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    if mask_at is not None:
        specials["<mask>"] = mask_at % vocab_size
    ids = [i for i in range(4, vocab_size) if i not in specials.values()]
    vocab = {**specials, **{f"w{j}": i for j, i in enumerate(ids)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return path


def with_tokenizer(name: str, dst: Path) -> Path:
    """A copy of the fixture ``name`` at ``dst`` with a tokenizer.json of exactly its vocabulary (its own where it
    has one; an encoder's with ``<mask>`` last)."""
    shutil.copytree(FIXTURES / name, dst)
    if not (dst / "tokenizer.json").is_file():
        hf = json.loads((dst / "config.json").read_text())
        write_tokenizer(dst / "tokenizer.json", hf["vocab_size"],
                        mask_at=-1 if hf["model_type"] in ENCODER_TYPES else None)
    return dst
