"""Evaluation protocols: every token scored once; stream and sliding agree."""

import json
import math

import ml_collections
import numpy as np
import pytest

from longctx import runtime
from longctx.config import base_config, resolve_vocab, validate
from longctx.data.prepare import prepare
from longctx.errors import ConfigError
from longctx.evaluate import evaluate_split, position_bins
from longctx.models.decoder import build_model
from longctx.protocols import (
    Job,
    byte_cut_jobs,
    compressor_bits_per_byte,
    limit_jobs,
    run_jobs,
    score_split,
    sliding_jobs,
    stream_jobs,
    summarize,
)
from longctx.train.step import split_model
from tests.conftest import tiny_config


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


# ----------------------------------------------------------------------------------------------
# bits per byte for lossless tokenizers, resets every N bytes


def fake_forward(params, inputs, targets, state):
    """A stand-in model whose loss of a target is 0.01 * (id + 1) nats: every sum can be checked by hand."""
    return 0.01 * (np.asarray(targets, np.float64) + 1.0), state


def test_carried_states_of_many_stream_lengths_share_a_few_shapes():
    """Streams of 1..40 windows, two a batch: each batch's state is built for a power of two of windows (at most
    the longest batch's 40), holding what it runs: 6 shapes instead of 20; the scores are those of the stand-in."""
    window, built = 8, []

    def init_state(b, n):
        built.append(n)
        return n

    def forward(params, inputs, targets, state):
        assert state is None or state >= inputs.shape[1], state
        return fake_forward(params, inputs, targets, state)

    starts = np.cumsum([0] + [w * window + 1 for w in range(1, 41)])
    jobs = stream_jobs(starts, reset="document", row_len=-1)
    tokens = np.arange(starts[-1] + 1) % 50
    nll, count, *_ = run_jobs(forward, None, tokens, jobs, window=window, batch_size=2, init_state=init_state,
                              progress=False)
    wins = [w for w in range(40, 0, -2)]  # the batches' windows, longest first: (40, 39), (38, 37), ...
    assert built == [{40: 40, 38: 40, 36: 40, 34: 40}.get(w, 1 << (w - 1).bit_length()) * window for w in wins]
    assert sorted(set(built)) == [w * window for w in (2, 4, 8, 16, 32, 40)]  # 6 shapes, not 20
    assert count == sum(j.n - j.score_from for j in jobs)


def stream_cfg(**kw):
    return ml_collections.ConfigDict({"protocol": "stream", "reset": "document", "row_len": -1, "window": 64,
                                      "batch_size": 4, "max_tokens": 0, "max_bytes": 0, **kw})


def bpe_data(corpus, cache, split="valid"):
    cfg = tiny_config(corpus, cache)
    cfg.data.tokenizer, cfg.data.options.vocab_size = "bpe", 300
    tok, data, _ = prepare(cfg.data, [split], progress=False)
    return tok, data[split]


def test_bpe_bits_per_byte_is_the_loss_over_the_scored_bytes(tiny_corpus, tmp_path):
    tok, data = bpe_data(tiny_corpus, tmp_path / "cache")
    res, (sums, counts, nbytes) = score_split(fake_forward, None, data, stream_cfg(), init_state=lambda b, n: None,
                                              tokenizer=tok, compressors=True, progress=False)
    tokens, starts = np.asarray(data.tokens), data.doc_starts
    lengths = tok.byte_lengths()
    nll = n_bytes = first = 0
    scored = b""
    h_sum, h_cnt, h_bytes = np.zeros_like(sums), np.zeros_like(counts), np.zeros_like(nbytes)
    for a, b in zip(starts[:-1], starts[1:]):
        t = tokens[a + 1 : b]
        nll += float((0.01 * (t + 1.0)).sum())
        n_bytes += int(lengths[t].sum())
        first += int(lengths[tokens[a]])
        scored += tok.decode_bytes(t)
        at = np.cumsum(lengths[tokens[a : b - 1]]) - 1  # bytes read before each target, less one
        np.add.at(h_sum, at, 0.01 * (t + 1.0))
        np.add.at(h_cnt, at, 1)
        np.add.at(h_bytes, at, lengths[t])
    assert res["tokens_scored"] == data.num_tokens - data.num_docs and res["bytes_scored"] == n_bytes
    assert res["bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-12)
    assert res["bits_per_token"] == pytest.approx(nll / res["tokens_scored"] / math.log(2), rel=1e-12)
    assert res["bytes_in_split"] - res["bytes_scored"] == first  # each document's first token, unscored
    assert res["compressors_bits_per_byte"] == compressor_bits_per_byte(scored)
    np.testing.assert_allclose(sums, h_sum, rtol=1e-12)
    assert (counts == h_cnt).all() and (nbytes == h_bytes).all()
    bins = position_bins(sums, counts, byte_counts=nbytes)
    assert sum(b["bytes"] for b in bins) == n_bytes


def test_byte_tokenizer_numbers_unchanged_with_the_byte_table(tiny_cfg):
    tok, splits, _ = prepare(tiny_cfg.data, ["valid"], progress=False)
    data = splits["valid"]
    kw = dict(init_state=lambda b, n: None, progress=False, compressors=True)
    old, (s0, c0, b0) = score_split(fake_forward, None, data, stream_cfg(), one_token_per_byte=True, **kw)
    new, (s1, c1, b1) = score_split(fake_forward, None, data, stream_cfg(), one_token_per_byte=True, tokenizer=tok,
                                    **kw)
    for res in (old, new):
        assert res["bits_per_byte"] == res["nll_sum_nats"] / res["tokens_scored"] / math.log(2)  # bit for bit
        assert res["bits_per_byte"] == res["bits_per_token"] and res["bytes_scored"] == res["tokens_scored"]
    assert old["bits_per_byte"] == new["bits_per_byte"]
    assert old["compressors_bits_per_byte"] == new["compressors_bits_per_byte"]
    assert (s0 == s1).all() and (c0 == c1).all() and (b0 == c0).all()


@pytest.mark.parametrize("row_bytes", [1, 5, 7, 64])
def test_byte_cuts_reset_every_n_bytes_and_score_every_token_once(row_bytes):
    doc_starts = np.array([0, 10, 11, 30, 52, 53, 90])
    ones = np.ones(90, np.int64)
    assert byte_cut_jobs(doc_starts, ones, row_bytes=row_bytes) == stream_jobs(doc_starts, reset="document",
                                                                               row_len=row_bytes)
    lengths = np.random.default_rng(row_bytes).integers(1, 9, 90)
    jobs = byte_cut_jobs(doc_starts, lengths, row_bytes=row_bytes)
    pos = scored_positions(jobs)
    assert len(pos) == len(set(pos)) and set(pos) == set(range(90)) - set(doc_starts[:-1].tolist())
    for j in jobs:  # a job reads the tokens that start inside one span of row_bytes bytes of its document
        a = doc_starts[np.searchsorted(doc_starts, j.start, side="right") - 1]
        first_byte = np.cumsum(lengths[a : j.start + j.n]) - lengths[a : j.start + j.n]
        assert len(set((first_byte[j.start - a :] // row_bytes).tolist())) == 1


@pytest.mark.slow  # trains: compile-bound, about 20 s
def tiny_bpe_run(tiny_corpus, tmp_path):
    """A tiny decoder trained 2 steps over a BPE of 300 tokens: (its config, its workdir)."""
    from longctx import cli

    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1, eval_every=2, ckpt_every=2)
    cfg.data.options.vocab_size = 300
    cfg.eval.max_tokens = 0
    path = tmp_path / "c.py"
    path.write_text(f"import ml_collections\ndef get_config():\n    return ml_collections.ConfigDict({cfg.to_dict()!r})\n")
    wd = tmp_path / "w"
    assert cli.train_main(["longctx-train", f"--config={path}", f"--workdir={wd}", "--noprogress",
                           "--config.data.tokenizer=bpe"]) == 0
    return cfg, wd


def test_context_table_of_a_tiny_bpe_run(tiny_corpus, tmp_path):
    """End to end: longctx-train with data.tokenizer=bpe, longctx-eval in bits per byte, the reset table."""
    from longctx import cli
    from longctx.evaluate import context_main

    cfg, wd = tiny_bpe_run(tiny_corpus, tmp_path)
    assert cli.eval_main(["longctx-eval", f"--workdir={wd}", "--noprogress", "--split=valid",
                          "--config.eval.row_len=-1"]) == 0
    ev = json.loads(next((wd / "eval").glob("valid_step2_stream*.json")).read_text())
    assert ev["bits_per_byte"] < ev["bits_per_token"] and ev["bytes_scored"] > ev["tokens_scored"]
    assert ev["position_unit"] == "bytes from the file's start" and "bits_per_byte" in ev["by_position"][0]
    assert context_main(["--workdir", str(wd), "--split", "valid", "--resets", "16,64", "--noprogress"]) == 0
    table = json.loads((wd / "eval" / "valid_step2_context.json").read_text())
    carried, r16, r64 = table["rows"]
    assert carried["bits_per_byte"] == pytest.approx(ev["bits_per_byte"], rel=1e-6)
    assert carried["bytes_scored"] == r16["bytes_scored"] == r64["bytes_scored"] == ev["bytes_scored"]
    assert carried["tokens_scored"] == r16["tokens_scored"] and r16["bits_per_byte"] != carried["bits_per_byte"]
    assert (wd / "eval" / "valid_step2_context.md").read_text().count("| ") >= 3
    assert (wd / "eval" / "valid_step2_context_bpb_vs_position.png").stat().st_size > 0
    # a byte budget: the result file says it (-b500), the reset table scores the same bytes in every row
    assert cli.eval_main(["longctx-eval", f"--workdir={wd}", "--noprogress", "--split=valid",
                          "--config.eval.max_bytes=500"]) == 0
    cut = json.loads(next((wd / "eval").glob("valid_step2_stream*-b500.json")).read_text())
    assert cut["protocol"]["max_bytes"] == 500 and 0 < cut["bytes_scored"] <= 500
    assert context_main(["--workdir", str(wd), "--split", "valid", "--resets", "16", "--max_bytes", "500",
                         "--noprogress"]) == 0
    table = json.loads((wd / "eval" / "valid_step2_context.json").read_text())
    assert table["budget"] == "the first 500 scored bytes (eval.max_bytes)" and table["bytes_in_split"] is None
    assert [r["bytes_scored"] for r in table["rows"]] == [cut["bytes_scored"]] * 2


def test_a_dense_run_scored_over_a_sliding_window(tiny_corpus, tmp_path):
    """--also_as swa scores a dense run over a window of its trained length with the same parameters: a reset
    shorter than the window gives dense's numbers; only dense and swa swap, in one line otherwise."""
    from longctx.evaluate import context_main
    from longctx.runtime import _check_window_swap, check_run_overrides

    cfg, wd = tiny_bpe_run(tiny_corpus, tmp_path)
    assert context_main(["--workdir", str(wd), "--split", "valid", "--resets", "16", "--noprogress",
                         "--also_as", "swa", "--out", str(tmp_path / "cmp")]) == 0
    dense = json.loads((wd / "eval" / "valid_step2_context.json").read_text())
    swa = json.loads((wd / "eval" / "valid_step2_context_as_swa.json").read_text())
    assert dense["method"] == "dense" and swa["method"] == f"swa, window {cfg.train.seq_len}"
    over = {"model.attention.name": "swa", "model.attention.swa.window": 8}
    assert runtime.Runner.from_workdir(wd, overrides=over).cfg.model.attention.swa.window == 8  # a window given wins
    assert swa["rows"][1]["bits_per_byte"] == pytest.approx(dense["rows"][1]["bits_per_byte"], rel=1e-5)
    assert "(swa, window" in (tmp_path / "cmp" / "valid_context_compare.md").read_text()
    with pytest.raises(ConfigError, match="changes only between dense and swa"):
        check_run_overrides({"model.attention.name": "eva"})
    tvq = base_config()
    tvq.model.attention.name = "transformer_vq"
    with pytest.raises(ConfigError, match="only a dense or swa run"):
        _check_window_swap(tvq, {"model.attention.name": "swa"})


# ----------------------------------------------------------------------------------------------
# eval.max_bytes: a budget in bytes, the same bytes whatever the tokenizer


def scored_in_order(jobs):
    return [p for j in jobs for p in range(j.start + 1 + j.score_from, j.start + 1 + j.n)]


@pytest.mark.parametrize("kind", ["stream", "sliding", "byte_cuts"])
def test_max_bytes_cuts_at_the_last_token_within_the_budget(kind):
    doc_starts = np.array([0, 10, 11, 30, 52, 53, 90])
    lengths = np.random.default_rng(3).integers(1, 9, 90)
    ones = np.ones(90, np.int64)

    def jobs_of(tb):
        if kind == "stream":
            return stream_jobs(doc_starts, reset="document", row_len=7)
        if kind == "sliding":
            return sliding_jobs(doc_starts, reset="document", context=8, stride=3)
        return byte_cut_jobs(doc_starts, tb, row_bytes=13)

    full = scored_in_order(jobs_of(lengths))
    total = int(lengths[full].sum())
    for budget in (1, 2, 7, 8, 9, 50, 123, total - 1, total, total + 5):
        cut = limit_jobs(jobs_of(lengths), max_bytes=budget, token_bytes=lengths)
        pos = scored_in_order(cut)
        assert pos == full[: len(pos)]  # the jobs in order, the last one cut
        scored = int(lengths[pos].sum())
        assert scored <= budget and (pos == full or scored + lengths[full[len(pos)]] > budget)
        assert all(j.n > j.score_from for j in cut)
    for n in (1, 5, 13, 40, 80, 200):  # one byte a token: exactly the jobs of max_tokens
        assert limit_jobs(jobs_of(ones), max_bytes=n, token_bytes=ones) == limit_jobs(jobs_of(ones), n)
    assert limit_jobs(jobs_of(lengths), 0, max_bytes=0, token_bytes=lengths) == jobs_of(lengths)
    both = limit_jobs(jobs_of(lengths), 20, max_bytes=60, token_bytes=lengths)  # the first of the two cuts
    assert len(scored_in_order(both)) <= 20 and int(lengths[scored_in_order(both)].sum()) <= 60
    assert scored_in_order(both) in (scored_in_order(limit_jobs(jobs_of(lengths), 20)),
                                     scored_in_order(limit_jobs(jobs_of(lengths), max_bytes=60, token_bytes=lengths)))
    for n, m in ((20, 60), (60, 20)):  # the trainer's validation on a byte run: min(tokens, bytes) as before
        assert limit_jobs(jobs_of(ones), n, max_bytes=m, token_bytes=ones) == limit_jobs(jobs_of(ones), min(n, m))


def test_byte_tokenizer_max_bytes_scores_what_max_tokens_did(tiny_cfg):
    tok, splits, _ = prepare(tiny_cfg.data, ["valid"], progress=False)
    data = splits["valid"]
    kw = dict(init_state=lambda b, n: None, progress=False, compressors=True, one_token_per_byte=True, tokenizer=tok)
    for n, extra in ((300, {}), (301, {}), (1000, {"row_bytes": 16})):
        by_tok, pos_t = score_split(fake_forward, None, data, stream_cfg(max_tokens=n), **kw, **extra)
        by_byte, pos_b = score_split(fake_forward, None, data, stream_cfg(max_bytes=n), **kw, **extra)
        assert by_byte["protocol"].pop("max_bytes") == n and by_tok["protocol"].pop("max_tokens") == n
        assert by_byte.pop("budget") == f"the first {n:,} scored bytes (eval.max_bytes)"
        assert by_tok.pop("budget") == f"the first {n:,} scored tokens (eval.max_tokens)"
        by_tok.pop("seconds"), by_byte.pop("seconds")
        assert by_tok == by_byte and by_byte["bytes_scored"] == n  # bit for bit
        assert all((a == b).all() for a, b in zip(pos_t, pos_b))


def test_default_config_scores_the_same_bytes_as_before():
    """configs/default.py moved its test budget from 262,144 tokens to 262,144 bytes: the byte runs built on it
    (and its :tiny variant) score exactly the jobs they scored before."""
    from longctx import config_files
    from longctx.protocols import make_jobs

    doc_starts = np.concatenate([np.arange(0, 400_000, 7_919), [400_000]])
    ones = np.ones(400_000, np.int64)
    for spec, n in (("configs/default.py", 262144), ("configs/default.py:tiny", 16384)):
        cfg = validate(config_files.load(spec))
        assert cfg.data.tokenizer == "bytes" and (cfg.eval.max_tokens, cfg.eval.max_bytes) == (0, n)
        before = ml_collections.ConfigDict({**cfg.eval.to_dict(), "max_tokens": n, "max_bytes": 0})
        for protocol in ("stream", "sliding"):
            now = ml_collections.ConfigDict({**cfg.eval.to_dict(), "protocol": protocol})
            then = ml_collections.ConfigDict({**before.to_dict(), "protocol": protocol})
            jobs, window, _ = make_jobs(now, doc_starts, ones)
            assert (jobs, window) == make_jobs(then, doc_starts)[:2]
            assert sum(j.n - j.score_from for j in jobs) == n


def test_bpe_max_bytes_and_a_tokenizer_without_bytes(tiny_corpus, tmp_path):
    from longctx.errors import ConfigError

    tok, data = bpe_data(tiny_corpus, tmp_path / "cache")
    longest = int(tok.byte_lengths().max())
    kw = dict(init_state=lambda b, n: None, progress=False, tokenizer=tok)
    for budget in (100, 1001):
        res, _ = score_split(fake_forward, None, data, stream_cfg(max_bytes=budget), **kw)
        assert budget - longest < res["bytes_scored"] <= budget and res["protocol"]["max_bytes"] == budget
        assert "bytes_in_split" not in res and res["budget"] == f"the first {budget:,} scored bytes (eval.max_bytes)"
        ctx, _ = score_split(fake_forward, None, data, stream_cfg(max_bytes=budget), row_bytes=32, **kw)
        assert ctx["bytes_scored"] == res["bytes_scored"] and ctx["tokens_scored"] == res["tokens_scored"]
    with pytest.raises(ConfigError, match=r"eval.max_bytes=100 counts bytes: it needs a lossless tokenizer"):
        score_split(fake_forward, None, data, stream_cfg(max_bytes=100), init_state=lambda b, n: None, progress=False)


def test_max_bytes_in_the_config_the_file_name_and_the_printout(tiny_cfg):
    from longctx.config import one_budget
    from longctx.errors import ConfigError
    from longctx.evaluate import format_eval, protocol_tag

    c = ml_collections.ConfigDict(tiny_cfg.to_dict())
    c.eval.max_tokens, c.eval.max_bytes = 0, 4096
    assert protocol_tag(validate(c)) == "stream-w32-document32-b4096"
    c.eval.max_tokens = 100
    with pytest.raises(ConfigError, match=r"^eval.max_tokens=100 and eval.max_bytes=4096: give one budget"):
        validate(c)
    c.eval.max_tokens, c.model.kind, c.model.causal = 0, "encoder", False
    with pytest.raises(ConfigError, match=r"^eval.max_bytes=4096 is for decoders"):
        validate(c)
    assert one_budget({"eval.max_tokens": 64}) == {"eval.max_tokens": 64, "eval.max_bytes": 0}
    assert one_budget({"eval.max_bytes": 64, "eval.split": "test"}) == {"eval.max_bytes": 64, "eval.split": "test",
                                                                        "eval.max_tokens": 0}
    assert one_budget({"eval.max_tokens": 1, "eval.max_bytes": 2}) == {"eval.max_tokens": 1, "eval.max_bytes": 2}
    assert one_budget(None) == {} and one_budget({"eval.max_bytes": 0}) == {"eval.max_bytes": 0}
    res = summarize(10.0, 20, one_token_per_byte=False, protocol={"mode": "stream-with-state", "max_bytes": 64},
                    bytes_scored=61)
    res["budget"] = "the first 64 scored bytes (eval.max_bytes)"
    assert "bytes scored    61: the first 64 scored bytes (eval.max_bytes)" in format_eval(res)


def test_a_budget_given_on_the_command_line_replaces_the_files_other_one():
    """``--config.eval.max_tokens=N`` on a config file that sets ``eval.max_bytes`` (configs/default.py) scores N
    tokens: the file's byte budget goes to 0 (two budgets > 0 would be refused); both given: as given."""
    from longctx import cli

    argv = ["longctx-train", "--config=configs/default.py", "--workdir=/tmp/unused", "--config.eval.max_tokens=100"]
    _, cfg = cli.parse(argv, "longctx-train", config="file")
    assert (cfg.eval.max_tokens, cfg.eval.max_bytes) == (100, 0)
    validate(cfg)
    _, cfg = cli.parse(argv[:3], "longctx-train", config="file")
    assert (cfg.eval.max_tokens, cfg.eval.max_bytes) == (0, 262144)
    _, cfg = cli.parse(argv + ["--config.eval.max_bytes=7"], "longctx-train", config="file")
    assert (cfg.eval.max_tokens, cfg.eval.max_bytes) == (100, 7)


def test_a_diagnostic_word_count_is_said_beside_the_word_perplexity():
    """A copy of PG-19 / WikiText-103 that is not the official split has a counted word total: the printed result
    says so (the official counts print as before)."""
    from longctx.evaluate import format_eval

    res = {"protocol": {"mode": "stream"}, "tokens_scored": 10, "bits_per_token": 1.0, "token_perplexity": 2.0,
           "word_perplexity": 3.0, "word_count": 5, "tokens_per_word": 2.0}
    diag = "whitespace count of this copy (diagnostic only: not the official PG-19 split)"
    assert f"word count: {diag})" in format_eval({**res, "word_count_kind": diag})
    assert "word count:" not in format_eval({**res, "word_count_kind": "official (Rae et al. 2020, Table 2)"})
