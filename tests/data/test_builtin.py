"""Built-in corpus, token files and the stateless batcher."""

import json

import numpy as np
import pytest

from longctx.data import builtin
from longctx.data.batching import Batcher
from longctx.data.prepare import cache_path, load_split, prepare, prepare_split
from longctx.data.tokenizers import ByteTokenizer
from longctx.errors import DataError


def test_split_is_a_stable_hash_of_the_path():
    assert builtin.split_of("os.py") == builtin.split_of("os.py")
    splits = [builtin.split_of(f"pkg/m{i}.py") for i in range(2000)]
    frac = {s: splits.count(s) / len(splits) for s in ("train", "valid", "test")}
    assert 0.86 < frac["train"] < 0.94 and 0.03 < frac["valid"] < 0.07 and 0.03 < frac["test"] < 0.07


def test_real_stdlib_metadata():
    src = builtin.BuiltinSource()
    meta = src.metadata()
    assert meta["file_count"] > 500 and meta["byte_count"] > 5_000_000
    assert meta["python_version"].count(".") == 2 and len(meta["content_hash"]) == 64
    assert sum(s["files"] for s in meta["splits"].values()) == meta["file_count"]
    assert src.files("train")[:3] == sorted(src.files("train"))[:3]


def test_prepare_is_idempotent_and_round_trips(tiny_cfg):
    tok, data, directory = prepare(tiny_cfg.data, progress=False)
    src = builtin.BuiltinSource(tiny_cfg.data)
    for split in ("train", "valid", "test"):
        raw = b"".join(b for _, b in src.documents(split))
        assert data[split].num_tokens == len(raw)
        assert bytes(np.asarray(data[split].tokens)) == raw
        assert data[split].num_docs == len(src.files(split))
    stamp = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    prepare(tiny_cfg.data, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == stamp
    load_split(directory, "train", verify=True)


def test_interrupted_prepare_leaves_nothing_that_looks_complete(tiny_cfg, monkeypatch):
    src = builtin.BuiltinSource(tiny_cfg.data)
    meta = src.metadata()
    directory = cache_path(meta, "bytes", tiny_cfg.data.cache_dir)

    def broken(split):
        yield "a.py", b"x" * 100
        raise KeyboardInterrupt

    monkeypatch.setattr(src, "documents", broken)
    with pytest.raises(KeyboardInterrupt):
        prepare_split(src, ByteTokenizer(), "train", directory, source_meta=meta, progress=False)
    assert not (directory / "train.json").exists() and not (directory / "train.bin").exists()
    assert not list(directory.glob(".*tmp*"))
    with pytest.raises(DataError, match="longctx-prepare"):
        load_split(directory, "train")


def test_corrupt_token_file_is_detected(tiny_cfg):
    _, _, directory = prepare(tiny_cfg.data, ["valid"], progress=False)
    man = json.loads((directory / "valid.json").read_text())
    with open(directory / "valid.bin", "r+b") as f:
        f.write(b"\xff\xfe")
    with pytest.raises(DataError, match="checksum"):
        load_split(directory, "valid", verify=True)
    with open(directory / "valid.bin", "ab") as f:
        f.write(b"extra")
    with pytest.raises(DataError):
        load_split(directory, "valid")
    assert man["num_tokens"] > 0


def test_batcher_is_pure_and_rows_stay_inside_documents(tiny_cfg):
    _, data, _ = prepare(tiny_cfg.data, ["train"], progress=False)
    d = data["train"]
    b1 = Batcher(d, row_len=33, batch_size=8, seed=3)
    b2 = Batcher(d, row_len=33, batch_size=8, seed=3)
    np.testing.assert_array_equal(b1.batch(17)["tokens"], b2.batch(17)["tokens"])
    assert not np.array_equal(b1.batch(17)["tokens"], b1.batch(18)["tokens"])
    doc_ids = d.doc_ids()
    for step in range(20):
        starts, docs = b1.row_starts(step)
        assert np.all(doc_ids[starts] == docs) and np.all(doc_ids[starts + 32] == docs)
    halves = [Batcher(d, row_len=33, batch_size=8, seed=3, shard=(i, 2)).batch(5)["tokens"] for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), b1.batch(5)["tokens"])


def test_batcher_rejects_rows_longer_than_every_document(tiny_cfg):
    _, data, _ = prepare(tiny_cfg.data, ["train"], progress=False)
    with pytest.raises(DataError, match="seq_len"):
        Batcher(data["train"], row_len=10**7, batch_size=2, seed=0)


def test_no_scored_test_byte_is_in_the_train_split():
    """The main job's test bytes (the first ``eval.max_bytes`` of the test split, files in order) were never trained
    on: the splits share no path and no scored test file has the content of a train file (empty files aside). Over
    the whole test split one 142-byte ``__init__.py`` equals a train file, past the scored bytes."""
    import hashlib

    from configs import main

    src = builtin.BuiltinSource()
    assert not set(src.files("test")) & set(src.files("train"))
    train = {hashlib.sha256(b).digest() for _, b in src.documents("train") if b}
    budget, seen = main.get_config().eval.max_bytes, 0
    assert budget > 0
    for path, text in src.documents("test"):
        if seen >= budget:
            break
        assert not text or hashlib.sha256(text).digest() not in train, path
        seen += len(text)
    assert seen >= budget
