"""``data.packing='segments'``: the rows of 'pack' with their document boundaries (segment ids, positions restarting
at each document), deterministic in (seed, step), every token trained on; one line for a split without documents;
a short training run takes them end to end."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from longctx.data.batching import Batcher, row_segments
from longctx.data.prepare import TokenData
from longctx.errors import DataError


def _data(lengths, seed=0):
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.random.default_rng(seed).integers(0, 256, int(starts[-1])).astype(np.int32)
    return TokenData(tokens=tokens, doc_starts=starts, manifest={})


def test_rows_carry_segment_ids_and_positions_that_restart_at_each_document():
    data = _data(np.random.default_rng(1).integers(1, 30, 300))  # documents shorter and longer than a row
    L = 33
    b = Batcher(data, row_len=L, batch_size=16, seed=3, packing="segments")
    pack = Batcher(data, row_len=L, batch_size=16, seed=3, packing="pack")
    doc_of = data.doc_ids()
    for step in (0, 5):
        batch = b.batch(step)
        assert np.array_equal(batch["tokens"], pack.batch(step)["tokens"])  # the same rows as 'pack'
        starts, _ = b.row_starts(step)
        idx = starts[:, None] + np.arange(L)[None, :]
        seg, pos = batch["segment_ids"], batch["positions"]
        assert seg.dtype == pos.dtype == np.int32 and seg.shape == pos.shape == (16, L)
        for r in range(16):
            docs = doc_of[idx[r]]
            # one segment id per document of the row, numbered 1, 2, 3, ... in order
            assert np.array_equal(seg[r], np.unique(docs, return_inverse=True)[1] + 1)
            # position = tokens since the document's start, counted from the row's first token
            first = np.maximum(data.doc_starts[docs], starts[r])
            assert np.array_equal(pos[r], idx[r] - first)
        again = Batcher(data, row_len=L, batch_size=16, seed=3, packing="segments").batch(step)
        assert all(np.array_equal(batch[k], again[k]) for k in batch)
    n = data.num_tokens
    line = b.summary()
    assert line.startswith("packing='segments'") and f"trains on {n:,} of {n:,} train tokens (100.00 %)" in line


def test_row_segments_on_a_small_layout():
    seg, pos = row_segments(np.array([0, 3, 10, 12, 30]), np.arange(1, 14)[None])
    assert seg.tolist() == [[1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 4, 4]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1]]


def test_a_split_of_one_document_is_refused_in_one_line():
    with pytest.raises(DataError, match=r"^data.packing='segments' keeps documents apart, but the train split is one "
                                        r"document of 500 tokens \(no boundaries\); use data.packing=pack or "
                                        r"document$"):
        Batcher(_data([500]), row_len=33, batch_size=4, seed=0, packing="segments")
    with pytest.raises(DataError, match="allowed: document, pack, segments"):
        Batcher(_data([500]), row_len=33, batch_size=4, seed=0, packing="greedy")


@pytest.mark.slow  # a short training run (about 15 s on 2 cores)
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_training_on_packed_rows_runs_and_reports_its_rule(tiny_cfg, tmp_path, kind):
    """A decoder (two windows per row carry the state across boundaries) and an encoder (the masked LM, the rows'
    segment ids and positions beside the masked inputs) train on packed rows."""
    from longctx.train.loop import train

    tiny_cfg.data.packing = "segments"
    tiny_cfg.model.kind = kind
    tiny_cfg.train.steps, tiny_cfg.train.window = 2, 16 if kind == "decoder" else 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train(tiny_cfg, tmp_path / "w", progress=False)
    assert summary["step"] == 2 and np.isfinite(summary["last_valid_bits_per_token"])
    assert "packing='segments'" in out.getvalue() and "(100.00 %)" in out.getvalue()


def test_auto_packs_a_corpus_of_documents_and_keeps_the_rest_unpacked():
    """``data.packing='auto'`` (the default) is 'segments' for a prepared corpus of several documents whose every
    layer takes segment ids, 'document' where it cannot (a train split of one document, a generated task that does
    not pack examples, an attention transfer, settings that refuse packed rows), and a rule given by name is
    itself; the line a run prints says which and why."""
    from longctx.config import base_config, packing_rule, resolve_packing

    c = base_config()
    assert c.data.packing == "auto"
    assert packing_rule(c, 40)[0] == "segments" and packing_rule(c)[0] == "segments"
    assert packing_rule(c, 1) == ("document", "the train split is one document")
    for rule in ("document", "pack", "segments"):
        c.data.packing = rule
        assert packing_rule(c, 1) == (rule, "")
    c.data.packing = "auto"
    out, line = resolve_packing(c, 1484)
    assert out.data.packing == "segments" and c.data.packing == "auto"
    assert line == "data.packing='auto' -> 'segments': a corpus of 1,484 documents whose every layer takes segment ids"
    c.data.source = "mqar"
    assert packing_rule(c, None) == ("document", "data.source='mqar' generates whole rows")
    c.data.synthetic.example_len = 40
    assert packing_rule(c, None)[0] == "segments"
    c = base_config()
    c.train.task = "attention_transfer"
    assert packing_rule(c, 40)[0] == "document"
    c = base_config()
    c.model.attention.name = "fma"
    c.model.attention.fma.release_zero_slots = True
    assert packing_rule(c, 40) == ("document", "fma's settings refuse packed rows")
    c = base_config()
    c.data.source = "enwik8"  # one document a split, known before its data is read (a dry run plans 'document')
    assert packing_rule(c) == ("document", "the train split is one document")


def test_a_run_says_what_auto_chose(tiny_cfg, tmp_path):
    """The first lines of a run on the built-in corpus name the rule 'auto' chose (segments: its files are
    documents) and the rows are packed."""
    from longctx.train.tasks import task_class

    assert tiny_cfg.data.packing == "auto"
    task = task_class(tiny_cfg)(tiny_cfg)
    assert task.cfg.data.packing == "segments" and task.packed()
    assert task.packing_line.startswith("data.packing='auto' -> 'segments': a corpus of ")
