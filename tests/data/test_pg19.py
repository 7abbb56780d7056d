"""PG-19 source: bucket layout, book order, one EOS per book, SentencePiece, word-level ppl."""

import math
import random
import sys
import types

import ml_collections
import numpy as np
import pytest

from longctx.config import base_config
from longctx.data import pg19, sources, spm, tokenizers
from longctx.data.prepare import prepare
from longctx.errors import ConfigError, DataError
from longctx.protocols import summarize

WORDS = ("the of and to a in that was he it his is with as had for you be at on not her him said which "
         "but this have from by they all my she were so one an would there their what me no when if who "
         "been we very or out them into upon could more some then man now little time did only like great").split()

BOOKS = {"train": [10, 2, 31, 4, 57, 6], "valid": [120, 9], "test": [300, 77, 88]}


def book_text(book_id, n_words=300):
    rng = random.Random(book_id)
    lines = []
    for _ in range(n_words // 10):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(10)))
    return f"\n\nBOOK {book_id}.\n\n" + "\n".join(lines) + "\n\n\n"


def write_pg19(root, books=BOOKS):
    rows = []
    for split, ids in books.items():
        d = root / pg19.FOLDERS[split]
        d.mkdir(parents=True, exist_ok=True)
        for b in ids:
            (d / f"{b}.txt").write_text(book_text(b), encoding="utf-8")
            rows.append(f"{b},Title of book {b},19{b % 100:02d},http://www.gutenberg.org/ebooks/{b}")
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root


def data_cfg(path, cache, tokenizer="sentencepiece", **options):
    c = base_config().data
    c.source = "pg19"
    c.tokenizer = tokenizer
    c.path = str(path)
    c.cache_dir = str(cache)
    c.options.vocab_size = 120
    for k, v in options.items():
        c.options[k] = v
    return ml_collections.ConfigDict(c.to_dict())


def test_books_in_id_order_stripped_and_marked_for_eos(tmp_path):
    write_pg19(tmp_path / "pg")
    src = sources.build(data_cfg(tmp_path / "pg", tmp_path / "cache"))
    docs = list(src.documents("train"))
    assert [name for name, _ in docs] == ["2", "4", "6", "10", "31", "57"]
    assert docs[0][1] == book_text(2).strip() and isinstance(docs[0][1], spm.TextWithEos)
    assert [n for n, _ in src.documents("valid")] == ["9", "120"]  # validation/ is the 'valid' split
    meta = src.metadata()
    assert meta["book_counts"] == {"train": 6, "valid": 2, "test": 3}
    assert meta["word_counts"]["test"] == sum(len(book_text(b).split()) for b in BOOKS["test"])
    assert "diagnostic" in meta["word_counts_kind"]["test"]


def test_official_book_counts_give_the_official_word_counts(tmp_path, monkeypatch):
    write_pg19(tmp_path / "pg")
    monkeypatch.setattr(pg19, "BOOKS", {"train": 28_602, "valid": 2, "test": 3})
    meta = pg19.PG19Source(path=str(tmp_path / "pg")).metadata()
    assert meta["word_counts"] == {"valid": 3_007_061, "test": 6_966_499}
    assert "Rae et al." in meta["word_counts_kind"]["test"]


def test_sentencepiece_trained_saved_reused_and_one_eos_per_book(tmp_path):
    write_pg19(tmp_path / "pg")
    cfg = data_cfg(tmp_path / "pg", tmp_path / "cache")
    tok, out, directory = prepare(cfg, progress=False)
    assert tok.name == "sentencepiece" and tok.vocab_size == 120 and np.dtype(tok.dtype) == np.uint16
    assert (tok.sp.pad_id(), tok.sp.eos_id(), tok.sp.unk_id(), tok.sp.bos_id()) == (0, 1, 2, -1)
    assert tok.sp.id_to_piece(1) == "</s>"
    for split, ids in BOOKS.items():
        d = out[split]
        assert d.num_docs == len(ids)
        toks = np.asarray(d.tokens)
        ends = d.doc_starts[1:] - 1
        assert np.all(toks[ends] == 1)  # each book ends with EOS
        assert int((toks == 1).sum()) == len(ids)  # and EOS appears nowhere else
        first = sorted(ids)[0]
        np.testing.assert_array_equal(toks[: d.doc_starts[1] - 1], tok.encode(book_text(first).strip()))
    # a prompt gets no EOS
    assert 1 not in tok.encode("the man said").tolist()
    model = directory / "spm.model"
    stamp = model.stat().st_mtime_ns
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    tok2, _, d2 = prepare(cfg, progress=False)
    assert d2 == directory and model.stat().st_mtime_ns == stamp
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == files
    assert tokenizers.build("sentencepiece", model_path=model).encode("the man").tolist() == tok.encode("the man").tolist()
    # another vocabulary size is another directory
    cfg.options.vocab_size = 110
    tok3, _, d3 = prepare(cfg, ["valid"], progress=False)
    assert d3 != directory and tok3.vocab_size == 110


def test_sentencepiece_uses_only_the_first_max_chars(tmp_path):
    texts = ["abc\n\ndef\nghij", "klm"]
    # each line costs its characters + 1 (its line break): 'abc' 4, '' 5, 'def' 9, then 2 left
    assert list(spm.training_lines(texts, max_chars=9)) == ["abc", "def"]
    assert list(spm.training_lines(texts, max_chars=11)) == ["abc", "def", "gh"]
    assert list(spm.training_lines(texts, max_chars=100)) == ["abc", "def", "ghij", "klm"]


def test_bytes_tokenizer_on_pg19(tmp_path):
    write_pg19(tmp_path / "pg")
    tok, out, _ = prepare(data_cfg(tmp_path / "pg", tmp_path / "cache", tokenizer="bytes"), ["test"], progress=False)
    expected = b"".join(book_text(b).strip().encode() for b in sorted(BOOKS["test"]))
    assert bytes(np.asarray(out["test"].tokens)) == expected and out["test"].num_docs == 3


def test_layout_errors(tmp_path):
    root = write_pg19(tmp_path / "pg")
    with pytest.raises(DataError, match="gs://deepmind-gutenberg"):
        pg19.PG19Source(path=str(tmp_path / "nothing-here"))
    (root / "extra").mkdir()
    with pytest.raises(DataError, match="metadata.csv"):
        pg19.PG19Source(path=str(root / "extra"))
    (root / "test" / "999.txt").write_text("orphan")
    with pytest.raises(DataError, match="no row"):
        list(pg19.PG19Source(path=str(root)).documents("test"))
    (root / "test" / "999.txt").unlink()
    for p in (root / "validation").iterdir():
        p.unlink()
    (root / "validation").rmdir()
    src = pg19.PG19Source(path=str(root))
    with pytest.raises(DataError, match="validation"):
        list(src.documents("valid"))
    (root / "metadata.csv").write_text("book_id,title,date,url,extra\n")
    with pytest.raises(DataError, match="4"):
        pg19.PG19Source(path=str(root))
    (root / "metadata.csv").write_text("book_id,short_book_title,publication_date,url\n")
    with pytest.raises(DataError, match="no header"):
        pg19.PG19Source(path=str(root))


def test_tfds_adapter_without_tfds_says_how_to_install(tmp_path, monkeypatch):
    write_pg19(tmp_path / "pg")
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    src = pg19.PG19Source(data_cfg(tmp_path / "pg", tmp_path / "cache", tfds=True))
    with pytest.raises(DataError, match=r"pip install -e '\.\[tfds\]' tensorflow"):
        list(src.documents("test"))


def test_tfds_adapter_points_the_builder_at_the_local_copy(tmp_path, monkeypatch):
    """A stand-in tensorflow_datasets records what the adapter asks of it."""
    root = write_pg19(tmp_path / "pg")
    calls = {}
    builder_mod = types.ModuleType("tensorflow_datasets.datasets.pg19.pg19_dataset_builder")
    builder_mod._DATA_DIR = "gs://deepmind-gutenberg"

    class Builder:
        def download_and_prepare(self, download_config):
            calls["data_dir_at_prepare"] = builder_mod._DATA_DIR
            calls["try_gcs"] = download_config.try_download_gcs

        def as_dataset(self, split, shuffle_files):
            calls["split"], calls["shuffle"] = split, shuffle_files
            return [{"book_id": np.int32(b), "book_text": book_text(b).strip().encode()} for b in (77, 300)]

    fake = types.ModuleType("tensorflow_datasets")
    fake.builder = lambda name, data_dir: calls.update(name=name, tfds_dir=data_dir) or Builder()
    fake.download = types.SimpleNamespace(DownloadConfig=lambda **kw: types.SimpleNamespace(**kw))
    fake.as_numpy = lambda ds: iter(ds)
    for name, mod in (("tensorflow_datasets", fake), ("tensorflow_datasets.datasets", types.ModuleType("d")),
                      ("tensorflow_datasets.datasets.pg19", types.ModuleType("p")),
                      ("tensorflow_datasets.datasets.pg19.pg19_dataset_builder", builder_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["tensorflow_datasets.datasets.pg19"].pg19_dataset_builder = builder_mod
    sys.modules["tensorflow_datasets.datasets"].pg19 = sys.modules["tensorflow_datasets.datasets.pg19"]
    fake.datasets = sys.modules["tensorflow_datasets.datasets"]
    src = pg19.PG19Source(data_cfg(root, tmp_path / "cache", tfds=True))
    docs = list(src.documents("valid"))
    assert calls["data_dir_at_prepare"] == str(root) and calls["try_gcs"] is False
    assert calls["name"] == "pg19" and calls["split"] == "validation" and calls["shuffle"] is False
    assert calls["tfds_dir"] == str(tmp_path / "cache" / "tfds")
    assert [n for n, _ in docs] == ["77", "300"] and isinstance(docs[0][1], spm.TextWithEos)
    assert src.metadata()["reader"] == "tfds pg19 builder"
    assert src.metadata()["content_hash"] != pg19.PG19Source(data_cfg(root, tmp_path / "cache")).metadata()["content_hash"]


def test_sentencepiece_needs_a_model():
    with pytest.raises(ConfigError, match="pg19"):
        tokenizers.build("sentencepiece")


def test_word_level_perplexity_arithmetic_uses_the_official_constant():
    # 9,197,032 tokens at 2.5 nats each over the 6,966,499 test words
    nll = 2.5 * 9_197_032
    res = summarize(nll, 9_197_032, one_token_per_byte=False, protocol={}, word_count=6_966_499)
    assert res["word_perplexity"] == pytest.approx(math.exp(nll / 6_966_499))
    assert res["tokens_per_word"] == pytest.approx(1.3202, abs=1e-4)
    assert "bits_per_byte" not in res
