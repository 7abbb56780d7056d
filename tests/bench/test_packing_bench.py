"""scripts/packing_bench.py's corpus of short documents: the cuts cover each file exactly, at character starts,
in the lengths asked for, the same for the same seed, each file in the built-in corpus's split of it."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from longctx.data.builtin import split_of

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "packing_bench.py"


@pytest.fixture(scope="module")
def pb():
    spec = importlib.util.spec_from_file_location("packing_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_piece_lengths_cover_and_respect_ranges(pb):
    rng = np.random.default_rng(3)
    for frac in (0.0, 0.3, 1.0):
        n = 50_000
        ks = pb.piece_lengths(n, rng, short=(10, 20), long=(100, 150), long_fraction=frac)
        assert sum(ks) == n
        inner = ks[:-1]  # the last piece is what remains
        assert all(10 <= k <= 20 or 100 <= k <= 150 for k in inner)
        longs = sum(k >= 100 for k in inner) / len(inner)
        assert longs == pytest.approx(frac, abs=0.1)
        assert ks[-1] <= 150


def test_cut_keeps_every_byte_at_character_starts(pb):
    data = ("αβγ déjà vu — 東京 " * 40).encode("utf-8")
    lengths = pb.piece_lengths(len(data), np.random.default_rng(0), short=(1, 7), long=(20, 30), long_fraction=0.2)
    pieces = pb.cut(data, lengths)
    assert b"".join(pieces) == data
    assert all(p for p in pieces)
    for p in pieces:
        p.decode("utf-8")  # a cut inside a character would raise
    assert len(pieces) > 50


def _root(tmp_path):
    root = tmp_path / "lib"
    rng = np.random.default_rng(1)
    names = [f"pkg{i % 3}/mod_{i}.py" for i in range(40)]
    for name in names:
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        words = rng.choice(["def", "return", "x", "=", "(", ")", "λ", "\n"], size=int(rng.integers(50, 800)))
        f.write_text("# " + name + "\n" + "".join(w if w == "\n" else w + "_" for w in words), encoding="utf-8")
    return root, sorted(names)


def test_make_corpus_is_deterministic_and_splits_by_file(pb, tmp_path):
    root, names = _root(tmp_path)
    kw = dict(seed=5, max_bytes=0, short=(16, 60), long=(200, 400), long_fraction=0.1, root=root)
    stats = pb.make_corpus(tmp_path / "a", **kw)
    pb.make_corpus(tmp_path / "b", **kw)
    for name in pb.SPLIT_FILES.values():
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    other = tmp_path / "c"
    pb.make_corpus(other, **{**kw, "seed": 6})
    assert (other / "train.jsonl").read_bytes() != (tmp_path / "a" / "train.jsonl").read_bytes()

    assert stats["files"] == len(names)
    for split, fname in pb.SPLIT_FILES.items():
        docs = [json.loads(x)["text"] for x in (tmp_path / "a" / fname).read_text(encoding="utf-8").splitlines()]
        whole = "".join((root / n).read_text(encoding="utf-8") for n in names if split_of(n) == split)
        assert "".join(docs) == whole  # each file whole, in sorted order, in its own split; nothing lost
        st = stats["splits"][split]
        assert st["documents"] == len(docs)
        assert st["bytes"] == sum(len(d.encode()) for d in docs)
        assert st["short_documents"] == sum(len(d.encode()) < 200 for d in docs)
    train = stats["splits"]["train"]
    assert 0 < train["short_documents"] < train["documents"]  # short pieces, and some a row long


def test_max_bytes_takes_a_subset(pb, tmp_path):
    root, names = _root(tmp_path)
    stats = pb.make_corpus(tmp_path / "s", seed=0, max_bytes=3000, root=root)
    assert 0 < stats["files"] < len(names)
    with pytest.raises(ValueError):
        pb.make_corpus(tmp_path / "bad", short=(900, 64), root=root)


def test_report_section_from_packing_md(tmp_path):
    """results/packing/packing.md -> one BENCHMARKS.md section holding it; none without the file."""
    from longctx.bench import report

    assert not any("packing" in p for p in report.extra_sections(tmp_path, "results"))
    (tmp_path / "packing").mkdir()
    (tmp_path / "packing" / "packing.md").write_text("| data.packing | trained on |\n|---|---|\n| segments | 100.00 % |\n")
    text = "\n".join(report.extra_sections(tmp_path, "results"))
    assert text.count("## Short documents: packing (`packing/`)") == 1
    assert "| segments | 100.00 % |" in text and "step `packing`" in text
