"""The byte-level BPE tokenizer (``data.tokenizer='bpe'``): lossless on any bytes, deterministic, trained on the
train split once and keyed in the token cache by its settings. A run trained with it end to end and scored in
bits per byte: tests/test_evaluate.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from longctx.data import bpe, sources
from longctx.data.prepare import prepare
from longctx.data.spm import TextWithEos
from tests.conftest import tiny_config

LATIN1 = "# -*- coding: latin-1 -*-\nname = 'Fran\xe7ois M\xfcller'  # caf\xe9\n\tx = '\xff\xfe\\x00'\n"


def bpe_cfg(corpus, cache, vocab=300, **train):
    cfg = tiny_config(corpus, cache, **train)
    cfg.data.tokenizer = "bpe"
    cfg.data.options.vocab_size = vocab
    return cfg


@pytest.fixture
def corpus(tiny_corpus):
    """The tiny corpus with a Latin-1 file (not UTF-8) and one with CRLF line ends and tabs."""
    (tiny_corpus / "latin1_mod.py").write_bytes(LATIN1.encode("latin-1"))
    (tiny_corpus / "pkg" / "crlf_mod.py").write_bytes(b"def f(x):\r\n\treturn  x\r\n\r\n\n   \n")
    return tiny_corpus


def test_lossless_on_random_bytes_non_utf8_files_and_every_prepared_document(corpus, tmp_path):
    cfg = bpe_cfg(corpus, tmp_path / "cache")
    tok, data, _ = prepare(cfg.data, progress=False)
    assert tok.vocab_size == 300 and tok.eos_id == 299 and not tok.one_token_per_byte
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 1000, 5000):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        ids = tok.encode(b)
        assert tok.decode_bytes(ids) == b and int(tok.byte_lengths()[ids].sum()) == n
    raw = LATIN1.encode("latin-1")
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")
    assert tok.decode_bytes(tok.encode(raw)) == raw
    text = "x = 'ünïcode ✓'\n    return x\n"
    assert tok.decode_bytes(tok.encode(text)) == text.encode() and tok.decode(tok.encode(text)) == text
    source = sources.build(cfg.data)
    for split, d in data.items():
        docs = [p for _, p in source.documents(split)]
        assert d.num_docs == len(docs)
        for i, doc in enumerate(docs):
            a, b = d.doc_starts[i], d.doc_starts[i + 1]
            assert tok.decode_bytes(d.tokens[a:b]) == doc
    merged = data["train"].num_tokens < sum(len(p) for _, p in source.documents("train"))
    assert merged  # the merges shorten the train split


def test_training_is_deterministic_and_uses_the_train_split_only(corpus, tmp_path):
    cfg = bpe_cfg(corpus, tmp_path / "cache")
    source = sources.build(cfg.data)
    docs = [p for _, p in source.documents("train")]
    first = bpe.train_model(docs, vocab_size=300)
    assert bpe.train_model(list(docs), vocab_size=300) == first
    kw_a = bpe.tokenizer_kwargs(cfg.data)
    cfg_b = bpe_cfg(corpus, tmp_path / "other_cache")
    kw_b = bpe.tokenizer_kwargs(cfg_b.data)
    assert kw_a["file_sha256"] == kw_b["file_sha256"] and kw_a["tokenizer_file"] != kw_b["tokenizer_file"]
    assert json.loads(Path(kw_a["tokenizer_file"]).read_text()) == json.loads(first)  # the train split's model


def test_cache_keyed_by_settings_and_the_model_reused(corpus, tmp_path):
    cfg = bpe_cfg(corpus, tmp_path / "cache")
    tok, _, d1 = prepare(cfg.data, ["valid"], progress=False)
    model = Path(tok.tokenizer_file)
    stamp = model.stat().st_mtime_ns
    tok2, _, d2 = prepare(cfg.data, ["valid"], progress=False)
    assert d2 == d1 and model.stat().st_mtime_ns == stamp  # trained once, then reused
    tok3, _, d3 = prepare(bpe_cfg(corpus, tmp_path / "cache", vocab=320).data, ["valid"], progress=False)
    assert d3 != d1 and Path(tok3.tokenizer_file) != model and tok3.vocab_size == 320


def test_end_of_document_id_has_no_bytes_and_ends_only_eos_payloads(corpus, tmp_path):
    tok, _, _ = prepare(bpe_cfg(corpus, tmp_path / "cache").data, ["valid"], progress=False)
    plain = tok.encode("def f():\n    return 1\n")
    with_eos = tok.encode(TextWithEos("def f():\n    return 1\n"))
    assert with_eos.tolist() == plain.tolist() + [tok.eos_id]
    assert tok.byte_lengths()[tok.eos_id] == 0 and tok.decode_bytes(with_eos) == tok.decode_bytes(plain)
    assert tok.eos_id not in tok.encode("<|endoftext|></s>" * 3).tolist()  # no text encodes to it
    lengths = tok.byte_lengths()
    assert (lengths[: tok.model.get_vocab_size()] >= 1).all()
    assert all(len(tok.pieces[i]) == lengths[i] for i in range(tok.vocab_size))
    assert sorted(p for p in tok.pieces if len(p) == 1) == [bytes([i]) for i in range(256)]


def test_your_own_files_take_the_bpe_too(tmp_path):
    """data.source='files' with data.tokenizer='bpe': the BPE is learned on the files' train split and every
    prepared document decodes to its text."""
    root = tmp_path / "mine"
    for split, n in (("train", 4), ("valid", 1)):
        (root / split).mkdir(parents=True)
        for i in range(n):
            (root / split / f"{i}.txt").write_text(f"The {split} document number {i}, caf\u00e9 and tea.\n" * (20 + i))
    cfg = bpe_cfg(root, tmp_path / "cache")
    cfg.data.source = "files"
    tok, data, _ = prepare(cfg.data, progress=False)
    assert tok.vocab_size == 300
    for split, n in (("train", 4), ("valid", 1)):
        d = data[split]
        assert d.num_docs == n and d.num_tokens < sum(len(p.read_bytes()) for p in (root / split).iterdir())
        texts = sorted(p.read_bytes() for p in (root / split).iterdir())
        got = sorted(tok.decode_bytes(np.asarray(d.tokens[a:b])) for a, b in zip(d.doc_starts[:-1], d.doc_starts[1:]))
        assert got == texts
