"""Your own corpus: text folders, JSONL, Parquet, Hugging Face datasets and tokenizers from local
files; the packing rule for short documents. Every corpus here is a few small files the test writes."""

from __future__ import annotations

import contextlib
import io
import json
import random
import socket
from pathlib import Path

import numpy as np
import pytest

from longctx.data import files as files_lib
from longctx.data.batching import Batcher
from longctx.data.prepare import prepare
from longctx.errors import ConfigError, DataError
from tests.conftest import tiny_config

WORDS = "the cat sat on a mat while dogs ran far away into night".split()


def texts(n, seed=0, lo=5, hi=30):
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi))) for _ in range(n)]


def text_folder(root: Path, docs) -> Path:
    for i, t in enumerate(docs):
        f = root / ("sub" if i % 2 else "") / f"doc{i:03d}.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(t + "\n")
    return root


def in_corpus_order(root: Path) -> list[str]:
    """The texts of the doc*.txt files under ``root``, in sorted order of their relative paths."""
    return [f.read_text() for f in sorted(root.rglob("doc*.txt"), key=lambda f: f.relative_to(root).as_posix())]


def jsonl_file(path: Path, docs, field="text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(docs)))
    return path


def parquet_file(path: Path, docs, field="text") -> Path:
    pa = pytest.importorskip("pyarrow", reason="Parquet needs the optional pyarrow (pip install -e '.[parquet]')")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=7)
    return path


def hf_tokenizer_file(path: Path, docs) -> Path:
    tk = pytest.importorskip("tokenizers", reason="needs the optional tokenizers (pip install -e '.[hf]')")
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return path


def files_cfg(path, cache, source="files", **options):
    cfg = tiny_config(path, cache, steps=2, warmup_steps=1, eval_every=100)
    cfg.data.source = source
    cfg.data.options.update(options)
    return cfg


def stream(data) -> list[str]:
    """The documents of a prepared byte-tokenized split, as text."""
    toks, starts = np.asarray(data.tokens), data.doc_starts
    return [bytes(toks[a:b].tolist()).decode() for a, b in zip(starts[:-1], starts[1:])]


# -- reading and splitting -------------------------------------------------------------------
def test_text_folder_split_by_seeded_fractions(tmp_path):
    docs = texts(40)
    root = text_folder(tmp_path / "corpus", docs)
    (root / "empty.txt").write_text("  \n")  # skipped
    (root / ".hidden").write_text("not read")
    cfg = files_cfg(root, tmp_path / "cache", split=(0.8, 0.1, 0.1), split_seed=3)
    tok, data, d = prepare(cfg.data, progress=False)
    assert d.name.startswith("files-bytes-") and tok.name == "bytes"
    got = {s: stream(data[s]) for s in ("train", "valid", "test")}
    assert [len(got[s]) for s in ("train", "valid", "test")] == [32, 4, 4]
    assert sorted(sum(got.values(), [])) == sorted(t + "\n" for t in docs)  # every document once, none lost
    # each split keeps corpus order (sorted relative paths); the same seed gives the same split, another another
    corpus_order = in_corpus_order(root)
    for split, got_docs in got.items():
        assert got_docs == [t for t in corpus_order if t in set(got_docs)], split
    _, again, d2 = prepare(files_cfg(root, tmp_path / "cache", split=(0.8, 0.1, 0.1), split_seed=3).data, progress=False)
    assert d2 == d and again["valid"].manifest["sha256"] == data["valid"].manifest["sha256"]
    _, other, d3 = prepare(files_cfg(root, tmp_path / "cache", split=(0.8, 0.1, 0.1), split_seed=4).data, progress=False)
    assert d3 != d and stream(other["valid"]) != got["valid"]


def test_explicit_split_files_and_formats_agree(tmp_path):
    """A folder with train / valid / test entries gives the splits; text, JSONL and Parquet of the
    same documents give the same token stream."""
    docs = texts(30, seed=1)
    root = tmp_path / "c"
    jsonl_file(root / "train.jsonl", docs[:20], field="body")
    parquet_file(root / "validation.parquet", docs[20:25], field="body")
    text_folder(root / "test", docs[25:])
    cfg = files_cfg(root, tmp_path / "cache", text_field="body")
    _, data, _ = prepare(cfg.data, progress=False)
    assert stream(data["train"]) == docs[:20] and stream(data["valid"]) == docs[20:25]
    assert stream(data["test"]) == in_corpus_order(root / "test")
    # the same as data.options.train_path / valid_path / test_path
    cfg2 = files_cfg("", tmp_path / "cache", text_field="body", train_path=str(root / "train.jsonl"),
                     valid_path=str(root / "validation.parquet"), test_path=str(root / "test"))
    _, data2, _ = prepare(cfg2.data, progress=False)
    assert {s: d.manifest["sha256"] for s, d in data2.items()} == {s: d.manifest["sha256"] for s, d in data.items()}


def test_separator_and_long_documents_streamed_in_pieces(tmp_path, monkeypatch):
    """Documents between markers, stripped; with tiny pieces and blocks (a long document handed to
    the tokenizer in pieces, a marker split across blocks) the token files are byte-identical."""
    docs = [("line %d " % i) * (3 + 7 * i) + "\nend" for i in range(12)]
    f = tmp_path / "c.txt.gz"
    import gzip

    f.write_bytes(gzip.compress(("\n<|endoftext|>\n".join(docs) + "\n<|endoftext|>\n\n").encode()))
    cfg = files_cfg(f, tmp_path / "cache", separator="<|endoftext|>", split=(1.0, 0.0, 0.0))
    _, whole, d = prepare(cfg.data, ["train"], progress=False)
    assert stream(whole["train"]) == [t.strip() for t in docs]
    monkeypatch.setattr(files_lib, "PIECE", 40)
    monkeypatch.setattr(files_lib, "BLOCK", 7)
    seen = []
    orig = files_lib.separated_docs
    monkeypatch.setattr(files_lib, "separated_docs", lambda *a: (seen.append(x) or x for x in orig(*a)))
    _, pieced, _ = prepare(files_cfg(f, tmp_path / "cache2", separator="<|endoftext|>", split=(1.0, 0.0, 0.0)).data,
                           ["train"], progress=False)
    assert sum(not last for _, _, last in seen) > 10  # long documents did come in pieces
    assert np.array_equal(np.asarray(pieced["train"].tokens), np.asarray(whole["train"].tokens))
    assert np.array_equal(pieced["train"].doc_starts, whole["train"].doc_starts)
    # one document per file, pieced the same way
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text(docs[-1] * 5)
    (tmp_path / "one" / "b.txt").write_text("short")
    _, one, _ = prepare(files_cfg(tmp_path / "one", tmp_path / "cache3", split=(1.0, 0.0, 0.0)).data, ["train"],
                        progress=False)
    assert stream(one["train"]) == [docs[-1] * 5, "short"]


@pytest.mark.parametrize("what,write,options,expect", [
    ("empty folder", lambda p: p.mkdir(), {}, r"empty folder: the corpus is empty"),
    ("only empty files", lambda p: (p.mkdir(), (p / "a.txt").write_text(" \n")), {}, r"no documents in .* corpus is empty"),
    ("missing field", lambda p: jsonl_file(p / "a.jsonl", ["x"], field="body"), {},
     r"line 1 has no field 'text' \(its fields: body, id\); set data.options.text_field"),
    ("not UTF-8", lambda p: (p.mkdir(), (p / "a.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))), {},
     r"a.txt is not UTF-8 text \(invalid continuation byte near byte 3\)"),
    ("not UTF-8 in JSONL", lambda p: (p.mkdir(), (p / "a.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')), {},
     r"a.jsonl line 1 is not UTF-8"),
    ("not JSON", lambda p: (p.mkdir(), (p / "a.jsonl").write_text("{oops\n")), {}, r"line 1 is not JSON"),
    ("bad split", lambda p: text_folder(p, texts(3)), {"split": (0.5, 0.6, 0.1)}, r"data.options.split="),
])
def test_bad_corpus_is_one_clear_error(tmp_path, what, write, options, expect):
    write(tmp_path / "c")
    with pytest.raises((DataError, ConfigError), match=expect):
        prepare(files_cfg(tmp_path / "c", tmp_path / "cache", **options).data, progress=False)


# -- packing -----------------------------------------------------------------------------------
def test_packing_trains_on_every_token_of_short_documents(tmp_path):
    docs = texts(200, seed=2, lo=2, hi=6)  # every document is shorter than a row of 33 tokens
    root = text_folder(tmp_path / "c", docs)
    cfg = files_cfg(root, tmp_path / "cache", split=(0.9, 0.05, 0.05))
    _, data, _ = prepare(cfg.data, ["train"], progress=False)
    n = data["train"].num_tokens
    with pytest.raises(DataError, match="no document has 33 tokens .*data.packing=pack"):
        Batcher(data["train"], row_len=33, batch_size=4, seed=0)
    b = Batcher(data["train"], row_len=33, batch_size=64, seed=0, packing="pack")
    assert b.tokens_usable == n and b.tokens_in_long_docs == 0 and b.short_docs == data["train"].num_docs
    assert f"trains on {n:,} of {n:,} train tokens (100.00 %)" in b.summary()
    assert f"packing='document' would train on 0 (0.00 %) and skips {n:,} in" in b.summary()
    # rows cross documents; every position can start a row; resuming gives the same rows
    rows = np.concatenate([b.row_starts(s)[0] for s in range(200)])
    assert rows.min() >= 0 and rows.max() <= n - 33 and len(np.unique(rows)) > 0.9 * min(len(rows), n - 32)
    assert np.array_equal(b.batch(7)["tokens"], Batcher(data["train"], row_len=33, batch_size=64, seed=0,
                                                         packing="pack").batch(7)["tokens"])
    # a mixed corpus: the default rule says how many tokens it skips
    mixed = text_folder(tmp_path / "m", texts(20, seed=3, lo=2, hi=6) + texts(20, seed=4, lo=40, hi=60))
    _, md, _ = prepare(files_cfg(mixed, tmp_path / "cache", split=(1.0, 0.0, 0.0)).data, ["train"], progress=False)
    bd = Batcher(md["train"], row_len=33, batch_size=4, seed=0)
    short = md["train"].doc_starts[1:] - md["train"].doc_starts[:-1] < 33
    skipped = int((md["train"].doc_starts[1:] - md["train"].doc_starts[:-1])[short].sum())
    assert f"skips {skipped:,} in {int(short.sum())} documents shorter than 33 tokens" in bd.summary()
    assert bd.summary().startswith("packing='document'")


# -- prepare, train a few steps, evaluate ------------------------------------------------------
def _corpus(kind, tmp_path):
    docs = texts(60, seed=5, lo=3, hi=8)  # short documents: the runs below pack them
    if kind == "text folder":
        return text_folder(tmp_path / "c", docs), {}
    if kind == "jsonl":
        return jsonl_file(tmp_path / "c.jsonl", docs), {}
    if kind == "parquet":
        return parquet_file(tmp_path / "c.parquet", docs), {}
    if kind == "hf datasets (json)":
        pytest.importorskip("datasets", reason="needs the optional datasets (pip install -e '.[hf]')")
        return jsonl_file(tmp_path / "c" / "part-0.jsonl", docs[:30]).parent and jsonl_file(
            tmp_path / "c" / "part-1.jsonl", docs[30:]).parent, {"source": "hf"}
    if kind == "hf tokenizer":
        root = text_folder(tmp_path / "c", docs)
        return root, {"tokenizer": "hf", "tokenizer_file": str(hf_tokenizer_file(tmp_path / "tok.json", docs))}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["text folder", "jsonl", "parquet", "hf datasets (json)", "hf tokenizer"])
def test_prepare_train_evaluate(tmp_path, kind, monkeypatch):
    from longctx.evaluate import evaluate_run
    from longctx.train.loop import train

    path, opts = _corpus(kind, tmp_path)
    source, tokenizer = opts.pop("source", "files"), opts.pop("tokenizer", "bytes")
    cfg = files_cfg(path, tmp_path / "cache", source=source, **opts)
    cfg.data.tokenizer, cfg.data.packing = tokenizer, "pack"

    def no_network(*a, **k):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train(cfg, tmp_path / "w", progress=False)
        res = evaluate_run(tmp_path / "w", split="test", overrides={"eval.max_tokens": 64}, progress=False)
    assert summary["step"] == 2 and np.isfinite(summary["last_valid_bits_per_token"])
    assert res["tokens_scored"] > 0 and np.isfinite(res["bits_per_token"])
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("model:"))
    assert "packing='pack'" in line and "(100.00 %)" in line and "packing='document' would train on" in line
    saved = json.loads((tmp_path / "w" / "config.json").read_text())
    if tokenizer == "hf":  # the tokenizer's vocabulary is the model's, and each document ends with its EOS
        import tokenizers

        assert saved["model"]["vocab_size"] == tokenizers.Tokenizer.from_file(opts["tokenizer_file"]).get_vocab_size(
            with_added_tokens=True) > 256
        assert "end-of-document token 0" in line
    else:
        assert saved["model"]["vocab_size"] == 256


# -- Hugging Face, offline ---------------------------------------------------------------------
def test_hf_never_reaches_for_the_hub(tmp_path):
    pytest.importorskip("datasets", reason="needs the optional datasets (pip install -e '.[hf]')")
    import os

    cfg = files_cfg("Salesforce/wikitext", tmp_path / "cache", source="hf")
    with pytest.raises(DataError, match=r"data.path='Salesforce/wikitext' is not a local file .*never downloads"):
        prepare(cfg.data, progress=False)
    cfg = files_cfg(jsonl_file(tmp_path / "c.jsonl", texts(10)), tmp_path / "cache", tokenizer_file="gpt2")
    cfg.data.tokenizer = "hf"
    with pytest.raises(DataError, match=r"tokenizer_file='gpt2' is not a local file .*never downloads"):
        prepare(cfg.data, progress=False)
    from longctx.data import hf

    hf.offline()
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"


def test_hf_tokenizer_file_encodes_with_eos_and_keys_the_cache(tmp_path):
    docs = texts(30, seed=6)
    tok_file = hf_tokenizer_file(tmp_path / "tok.json", docs)
    cfg = files_cfg(text_folder(tmp_path / "c", docs), tmp_path / "cache", tokenizer_file=str(tok_file))
    cfg.data.tokenizer = "hf"
    tok, data, d = prepare(cfg.data, progress=False)
    import tokenizers

    assert tok.vocab_size == tokenizers.Tokenizer.from_file(str(tok_file)).get_vocab_size(with_added_tokens=True)
    assert d.name.startswith("files-hf-") and 256 < tok.vocab_size <= 300 and tok.eos_id == 0
    ends = data["train"].doc_starts[1:] - 1
    assert np.all(np.asarray(data["train"].tokens)[ends] == 0)  # one <|endoftext|> closes each document
    assert data["train"].manifest["eos_id"] == 0 and data["train"].manifest["dtype"] == "uint16"
    first = np.asarray(data["train"].tokens[: data["train"].doc_starts[1] - 1])
    assert tok.decode(first) in {t + "\n" for t in docs}
    # another tokenizer file is another cache folder
    hf_tokenizer_file(tmp_path / "tok2.json", docs[:10])
    cfg.data.options.tokenizer_file = str(tmp_path / "tok2.json")
    assert prepare(cfg.data, ["valid"], progress=False)[2] != d
    (tmp_path / "bad.json").write_text('{"version": "1.0", "model": 3}')
    cfg.data.options.tokenizer_file = str(tmp_path / "bad.json")
    with pytest.raises(DataError, match=r"bad.json is not a Hugging Face tokenizer file"):
        prepare(cfg.data, progress=False)
