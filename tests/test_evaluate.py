"""Evaluation protocols: every token scored once; stream and sliding agree."""

import math

import ml_collections
import numpy as np
import pytest

from longctx import runtime
from longctx.config import resolve_vocab, validate
from longctx.data.prepare import prepare
from longctx.evaluate import evaluate_split
from longctx.models.decoder import build_model
from longctx.protocols import (
    Job,
    compressor_bits_per_byte,
    limit_jobs,
    sliding_jobs,
    stream_jobs,
    summarize,
)
from longctx.train.step import split_model


def scored_positions(jobs):
    out = []
    for j in jobs:
        out.extend(range(j.start + 1 + j.score_from, j.start + 1 + j.n))
    return out


@pytest.mark.parametrize("reset,row_len", [("document", 7), ("document", -1), ("row", 5), ("never", 0)])
def test_stream_jobs_score_every_token_once(reset, row_len):
    doc_starts = np.array([0, 10, 11, 30, 52])
    pos = scored_positions(stream_jobs(doc_starts, reset=reset, row_len=row_len))
    assert len(pos) == len(set(pos))
    expect = set(range(1, 52)) if reset in ("row", "never") else set(range(52)) - {0, 10, 11, 30}
    assert set(pos) == expect


@pytest.mark.parametrize("context,stride", [(8, 3), (5, 5), (100, 10), (1, 1)])
def test_sliding_jobs_score_every_token_once_with_bounded_context(context, stride):
    doc_starts = np.array([0, 10, 11, 30, 52])
    jobs = sliding_jobs(doc_starts, reset="document", context=context, stride=stride)
    pos = scored_positions(jobs)
    assert len(pos) == len(set(pos)) and set(pos) == set(range(52)) - {0, 10, 11, 30}
    assert all(j.n <= context for j in jobs)
    assert all(j.n - j.score_from <= max(stride, context) for j in jobs)


def test_limit_jobs_states_exact_count():
    jobs = [Job(0, 10), Job(20, 10, 4)]
    assert sum(j.n - j.score_from for j in limit_jobs(jobs, 13)) == 13


def test_metric_arithmetic():
    res = summarize(100.0 * math.log(2), 100, one_token_per_byte=True, protocol={}, word_count=40)
    assert res["bits_per_byte"] == pytest.approx(1.0)
    assert res["token_perplexity"] == pytest.approx(2.0)
    assert res["word_perplexity"] == pytest.approx(math.exp(100 * math.log(2) / 40))
    assert res["tokens_per_word"] == pytest.approx(2.5)
    c = compressor_bits_per_byte(b"abc" * 1000)
    assert 0 < c["gzip-9"] < 1 and 0 < c["xz-9e"] < 1


def test_loss_by_position_bins_are_log_spaced_and_count_their_tokens():
    from longctx.evaluate import position_bins

    sums, counts = np.full(1000, math.log(2)), np.ones(1000)
    counts[:10] = 0  # positions 1-10 not scored (the sliding protocol's)
    bins = position_bins(sums * counts, counts)
    assert sum(b["tokens"] for b in bins) == 990 and bins[0]["hi"] > 10 and bins[-1]["hi"] == 1000
    assert all(b["bits_per_token"] == pytest.approx(1.0) for b in bins)
    widths = [b["hi"] - b["lo"] + 1 for b in bins]
    assert widths[-1] > 10 * widths[0] and len(bins) <= 24


def make_runner(tiny_cfg):
    cfg = resolve_vocab(validate(tiny_cfg), 256)
    model = build_model(cfg.model, seed=0)
    graphdef, params, nongrad, rest = split_model(model)
    tok, data, _ = prepare(cfg.data, ["valid"], progress=False)
    return cfg, runtime.Runner(cfg, graphdef, params, nongrad, rest, tokenizer=tok), data["valid"]


def test_stream_and_sliding_agree_with_full_context(tiny_cfg):
    cfg, runner, data = make_runner(tiny_cfg)
    longest = int(np.diff(data.doc_starts).max())
    ecfg = ml_collections.ConfigDict(cfg.eval.to_dict())
    ecfg.max_tokens = 0
    s_cfg = ml_collections.ConfigDict({**ecfg.to_dict(), "protocol": "stream", "reset": "document", "row_len": -1,
                                      "window": 64})
    w_cfg = ml_collections.ConfigDict({**ecfg.to_dict(), "protocol": "sliding", "reset": "document",
                                      "context": longest, "stride": 16})
    rs, _ = evaluate_split(runner, data, s_cfg, progress=False)
    rw, _ = evaluate_split(runner, data, w_cfg, progress=False)
    assert rs["tokens_scored"] == rw["tokens_scored"] == data.num_tokens - data.num_docs
    assert rs["loss_nats_per_token"] == pytest.approx(rw["loss_nats_per_token"], rel=1e-5)
    short = ml_collections.ConfigDict({**w_cfg.to_dict(), "context": 8, "stride": 4})
    rshort, _ = evaluate_split(runner, data, short, progress=False)
    assert rshort["tokens_scored"] == rs["tokens_scored"]
    assert rshort["loss_nats_per_token"] != pytest.approx(rs["loss_nats_per_token"], rel=1e-7)
