"""Evaluation protocols: which tokens each forward call sees and which it scores.

Two protocols, each recorded in every result:

* ``stream``: the text is cut into segments at reset points (document starts and
  every ``row_len`` tokens, every ``row_len`` tokens of the stream, or never);
  each segment is run in windows of ``window`` tokens with the model state
  carried. Consecutive segments overlap by one token, so every token but the
  first of each document (or of the stream) is scored exactly once.
* ``sliding``: windows of context C advancing by stride S; only the last S
  positions of each window are scored (all of the first window's), so every
  token is again scored exactly once.

Bits per byte, for every lossless tokenizer (one whose ids stand for byte strings: :func:`byte_lengths`):
the loss summed over the scored tokens divided by the bytes those tokens stand for. A document's first token
is never scored (it is only read), so its bytes are left out of both sums: one byte with ``bytes``, the
first token's bytes with ``bpe``. The byte tokenizer's number is the loss per token, unchanged.

A budget scores the jobs in order up to it (:func:`limit_jobs`): ``eval.max_tokens`` scored tokens, or
``eval.max_bytes`` bytes of scored tokens (a lossless tokenizer: the same bytes whatever the tokenizer; with the
byte tokenizer the jobs of ``max_tokens``). Without one the whole split is scored.

Pure functions over a ``forward`` callable: no checkpoints, files or flags. Used by
``longctx-eval`` (:mod:`longctx.evaluate`) and by the trainer's periodic validation.
"""

from __future__ import annotations

import dataclasses
import gzip
import lzma
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from longctx.data.masking import mask_rows, num_masked
from longctx.errors import ConfigError, DataError

LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Job:
    """Inputs tokens[start : start + n], targets tokens[start + 1 : start + n + 1];
    predictions with index >= score_from are scored."""

    start: int
    n: int
    score_from: int = 0


class EvaluationStopped(Exception):
    """Raised between forward calls when a scoring function's ``stop()`` turns true (a signal asked the trainer to
    stop: it checkpoints and exits instead of finishing a long validation)."""


def _check_stop(stop) -> None:
    if stop is not None and stop():
        raise EvaluationStopped


def unit_ranges(doc_starts: np.ndarray, reset: str) -> list[tuple[int, int]]:
    """Token ranges that never share context: documents, or the whole stream."""
    if reset == "never" or reset == "row":
        return [(0, int(doc_starts[-1]))]
    return [(int(a), int(b)) for a, b in zip(doc_starts[:-1], doc_starts[1:])]


def byte_lengths(tokenizer) -> np.ndarray | None:
    """[vocab] int64 bytes per id of a lossless tokenizer (all ones for ``bytes``; a tokenizer's own
    ``byte_lengths()`` where it declares one), or None for a tokenizer that does not keep bytes."""
    if tokenizer is None:
        return None
    if getattr(tokenizer, "one_token_per_byte", False):
        return np.ones(int(tokenizer.vocab_size), np.int64)
    declared = getattr(tokenizer, "byte_lengths", None)
    return np.asarray(declared(), np.int64) if declared is not None else None


def byte_cut_jobs(doc_starts, token_bytes: np.ndarray, *, row_bytes: int) -> list[Job]:
    """Stream jobs that reset the state every ``row_bytes`` bytes inside each document, exactly: a document's
    segment k holds the tokens whose first byte lies in bytes [k * row_bytes, (k + 1) * row_bytes) of the
    document (``token_bytes`` [N]: the bytes of each token of the split). As in :func:`stream_jobs`, a segment
    reads its first token and scores the rest and the next segment's first token, so every token but the
    document's first is scored once. With one byte a token this is ``stream_jobs(reset='document',
    row_len=row_bytes)``."""
    if row_bytes <= 0:
        raise ConfigError(f"a reset every {row_bytes} bytes: give a positive number of bytes")
    jobs = []
    for a, b in unit_ranges(doc_starts, "document"):
        if b - a <= 1:
            continue
        starts = np.cumsum(token_bytes[a:b], dtype=np.int64) - token_bytes[a:b]  # each token's first byte
        k = starts // row_bytes
        cuts = [a] + [a + int(i) for i in np.flatnonzero(k[1:] != k[:-1]) + 1 if a + i < b - 1] + [b - 1]
        jobs.extend(Job(c, d - c) for c, d in zip(cuts[:-1], cuts[1:]))
    return jobs


def stream_jobs(doc_starts, *, reset: str, row_len: int) -> list[Job]:
    jobs = []
    for a, b in unit_ranges(doc_starts, reset):
        n_pred = b - a - 1
        if n_pred <= 0:
            continue
        step = n_pred if row_len <= 0 or reset == "never" else row_len
        for off in range(0, n_pred, step):
            jobs.append(Job(a + off, min(step, n_pred - off)))
    return jobs


def sliding_jobs(doc_starts, *, reset: str, context: int, stride: int) -> list[Job]:
    if context <= 0 or not 0 < stride <= context:  # validate() refuses these; never loop on them
        raise ConfigError(f"eval.context={context} and eval.stride={stride} must satisfy 0 < stride <= context")
    jobs = []
    for a, b in unit_ranges(doc_starts, "never" if reset == "never" else "document"):
        n_pred = b - a - 1
        if n_pred <= 0:
            continue
        end = min(context, n_pred)
        jobs.append(Job(a, end, 0))
        while end < n_pred:
            new_end = min(end + stride, n_pred)
            start = new_end - min(context, new_end)
            jobs.append(Job(a + start, new_end - start, end - start))
            end = new_end
    return jobs


def limit_jobs(jobs: list[Job], max_tokens: int = 0, *, max_bytes: int = 0,
               token_bytes: np.ndarray | None = None) -> list[Job]:
    """The first ``jobs`` in order, the last one cut short, so that exactly ``max_tokens`` tokens are scored
    (fewer where the jobs hold fewer; 0: no token budget). ``max_bytes`` > 0 counts the scored tokens' bytes
    instead (``token_bytes`` [N]: the bytes of each token of the split): the last job is cut at the last token
    whose bytes end within the budget, so bytes scored <= ``max_bytes`` < bytes scored + the longest token's
    bytes. With one byte a token, ``max_bytes=N`` gives the jobs of ``max_tokens=N``. Both > 0 (a config
    refuses it; the trainer's validation puts its token budget on top of the config's): the first of the two
    cuts."""
    if max_tokens <= 0 and max_bytes <= 0:
        return jobs
    if max_bytes > 0 and token_bytes is None:
        raise ConfigError(f"eval.max_bytes={max_bytes} counts bytes: it needs a lossless tokenizer (bytes or bpe), "
                          "and this one does not say how many bytes its tokens stand for; use eval.max_tokens")
    out, tokens, nbytes = [], 0, 0
    for j in jobs:
        scored = j.n - j.score_from
        keep = scored if max_tokens <= 0 else min(scored, max_tokens - tokens)
        if max_bytes > 0:
            first = j.start + 1 + j.score_from  # the first scored token (a target)
            ends = np.cumsum(token_bytes[first : first + keep], dtype=np.int64)  # bytes scored after each
            keep = int(np.searchsorted(ends, max_bytes - nbytes, side="right"))
            nbytes += int(ends[keep - 1]) if keep else 0
        if keep <= 0:
            return out
        out.append(j if keep == scored else Job(j.start, j.score_from + keep, j.score_from))
        tokens += keep
        if keep < scored:
            return out
    return out


def budget(ecfg) -> dict:
    """The scoring budget of an ``eval`` section as the protocol records it."""
    cut = {k: int(ecfg[k]) for k in ("max_tokens", "max_bytes") if int(ecfg[k]) > 0}
    return cut or {"max_tokens": "full split"}


def budget_text(ecfg) -> str:
    """The part of the split a budget scores, in words (``'the whole split'`` without one)."""
    cut = budget(ecfg)
    if "max_bytes" in cut:
        return f"the first {cut['max_bytes']:,} scored bytes (eval.max_bytes)" + (
            f", at most {cut['max_tokens']:,} tokens (eval.max_tokens)" if "max_tokens" in cut else "")
    if cut["max_tokens"] != "full split":
        return f"the first {cut['max_tokens']:,} scored tokens (eval.max_tokens)"
    return "the whole split"


def run_jobs(forward, params, tokens: np.ndarray, jobs: list[Job], *, window: int, batch_size: int,
             init_state=None, progress: bool = True, desc: str = "eval", token_bytes: np.ndarray | None = None,
             pad_to: int = 0, stop=None):
    """Score jobs; returns (nll_sum, count, per-position sums, per-position counts, per-position bytes or None).

    ``forward(params, inputs[B, W], targets[B, W], state) -> (nll[B, W], state)``; ``init_state(B, max_len)``
    gives the empty state when a job is longer than one window (state carried). Positions count tokens of
    context (position p: the p-th token of the job predicted the next), or, given ``token_bytes`` [N] (the
    bytes of each token of ``tokens``), bytes of context before the scored token (at least 1), with the bytes
    scored at each position. ``pad_to`` > 0: a job that fits one call is padded at its end to a multiple of
    ``pad_to`` tokens (fewer shapes to compile; the padding is never scored). A carried state is built for a
    power of two of windows (at most the longest batch's): streams of many lengths compile a handful of state
    shapes, not one per length, and the largest state is the one the longest batch needs anyway."""
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i].n)
    most_windows = max((-(-j.n // window) for j in jobs), default=1) if window > 0 else 1
    if token_bytes is None:
        longest = max((j.n for j in jobs), default=0)
        pos_bytes = None
    else:
        longest = max((int(token_bytes[j.start : j.start + j.n].sum()) for j in jobs), default=0)
        pos_bytes = np.zeros(longest, np.int64)
    pos_sum = np.zeros(longest, np.float64)
    pos_cnt = np.zeros(longest, np.int64)
    nll_sum, count = 0.0, 0
    total = scored_count(jobs)
    bar = tqdm(total=total, desc=desc, unit="tok", disable=not progress, leave=False)
    for b0 in range(0, len(order), batch_size):
        batch = [jobs[i] for i in order[b0 : b0 + batch_size]]
        B = batch_size
        n_max = max(j.n for j in batch)
        n_win = -(-n_max // window) if window > 0 else 1
        width = n_win * window if window > 0 else n_max
        if pad_to > 0 and n_win == 1:
            width = -(-n_max // pad_to) * pad_to
        inputs = np.zeros((B, width), np.int32)
        targets = np.zeros((B, width), np.int32)
        mask = np.zeros((B, width), bool)
        for r, j in enumerate(batch):
            seg = np.asarray(tokens[j.start : j.start + j.n + 1], np.int32)
            inputs[r, : j.n] = seg[:-1]
            targets[r, : j.n] = seg[1:]
            mask[r, j.score_from : j.n] = True
        state = None if n_win == 1 else init_state(B, state_windows(n_win, most_windows) * window)
        losses = []
        for w in range(n_win):
            _check_stop(stop)
            sl = slice(w * window, (w + 1) * window) if n_win > 1 else slice(0, width)
            nll_w, state = forward(params, jnp.asarray(inputs[:, sl]), jnp.asarray(targets[:, sl]), state)
            losses.append(np.asarray(nll_w))
        nll = np.concatenate(losses, axis=1)
        nll_sum += float(np.sum(nll, where=mask))
        count += int(mask.sum())
        if token_bytes is None:
            m = mask[:, :longest]
            pos_sum[: m.shape[1]] += np.where(m, nll[:, : m.shape[1]], 0).sum(0)
            pos_cnt[: m.shape[1]] += m.sum(0)
        else:
            for r, j in enumerate(batch):
                tb = np.asarray(token_bytes[j.start : j.start + j.n + 1], np.int64)
                at = np.maximum(np.cumsum(tb[:-1])[j.score_from :], 1) - 1  # bytes read before each scored token
                np.add.at(pos_sum, at, nll[r, j.score_from : j.n])
                np.add.at(pos_cnt, at, 1)
                np.add.at(pos_bytes, at, tb[1 + j.score_from :])
        bar.update(int(mask.sum()))
    bar.close()
    return nll_sum, count, pos_sum, pos_cnt, pos_bytes


def compressor_bits_per_byte(data: bytes) -> dict:
    if not data:
        return {}
    return {
        "gzip-9": 8.0 * len(gzip.compress(data, compresslevel=9)) / len(data),
        "xz-9e": 8.0 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data),
    }


def summarize(nll_sum: float, count: int, *, one_token_per_byte: bool, protocol: dict, word_count: int | None = None,
              bytes_scored: int | None = None) -> dict:
    """The result of a scoring: loss per token, and bits per byte where the tokens are bytes
    (``one_token_per_byte``) or ``bytes_scored`` (the bytes the scored tokens stand for) is given."""
    mean = nll_sum / max(count, 1)
    out = {
        "tokens_scored": count,
        "nll_sum_nats": nll_sum,
        "loss_nats_per_token": mean,
        "bits_per_token": mean / LN2,
        "token_perplexity": math.exp(min(mean, 700.0)),
        "protocol": protocol,
    }
    if one_token_per_byte:
        out["bits_per_byte"] = mean / LN2
    elif bytes_scored is not None:
        out["bits_per_byte"] = nll_sum / max(bytes_scored, 1) / LN2
    if bytes_scored is not None:
        out["bytes_scored"] = int(bytes_scored)
    if word_count:
        out["word_count"] = word_count
        out["word_perplexity"] = math.exp(min(nll_sum / word_count, 700.0))
        out["tokens_per_word"] = count / word_count
    return out


def make_jobs(ecfg, doc_starts, token_bytes: np.ndarray | None = None):
    """(jobs, window, protocol) of a validated ``eval`` section; ``token_bytes`` [N] (each token's bytes) for
    ``eval.max_bytes`` (:func:`limit_jobs`)."""
    jobs, window, protocol = protocol_jobs(ecfg, doc_starts)
    return limit_jobs(jobs, ecfg.max_tokens, max_bytes=ecfg.max_bytes, token_bytes=token_bytes), window, protocol


def scored_count(jobs: list[Job]) -> int:
    return sum(j.n - j.score_from for j in jobs)


def protocol_jobs(ecfg, doc_starts):
    """(every job of the split, window, protocol) of a validated ``eval`` section, before its budget."""
    if ecfg.protocol == "stream":
        jobs = stream_jobs(doc_starts, reset=ecfg.reset, row_len=ecfg.row_len)
        protocol = {"mode": "stream-with-state", "window": ecfg.window, "reset": ecfg.reset, "row_len": ecfg.row_len}
        window = ecfg.window
    else:
        jobs = sliding_jobs(doc_starts, reset=ecfg.reset, context=ecfg.context, stride=ecfg.stride)
        protocol = {"mode": "sliding-window", "context": ecfg.context, "stride": ecfg.stride, "reset": ecfg.reset}
        window = 0
    protocol.update(budget(ecfg))
    return jobs, window, protocol


def scored_ids(tokens, jobs: list[Job]) -> np.ndarray:
    """The scored tokens of ``jobs``, in job order."""
    parts = [np.asarray(tokens[j.start + 1 + j.score_from : j.start + 1 + j.n]) for j in jobs]
    return np.concatenate(parts) if parts else np.zeros(0, np.asarray(tokens[:0]).dtype)


def split_jobs(data, ecfg, *, tokenizer=None, one_token_per_byte: bool = False, row_bytes: int = 0):
    """What :func:`score_split` scores: (the tokenizer's byte table or None, whether one token is one byte, each
    token's bytes or None, the jobs, the window, the protocol record, whether the jobs score the whole split:
    no budget, or one the split ends within)."""
    table = byte_lengths(tokenizer)
    if table is None and one_token_per_byte:
        table = np.ones(256, np.int64)
    one_byte = one_token_per_byte or bool(getattr(tokenizer, "one_token_per_byte", False))
    token_bytes = table[np.asarray(data.tokens)] if table is not None else None
    if row_bytes > 0:
        if token_bytes is None:
            raise ConfigError("a reset every N bytes needs a lossless tokenizer (bytes or bpe): this one does not "
                              "say how many bytes its tokens stand for")
        every = byte_cut_jobs(data.doc_starts, token_bytes, row_bytes=row_bytes)
        window = ecfg.window
        protocol = {"mode": "stream-with-state", "window": ecfg.window, "reset": "document", "row_bytes": row_bytes,
                    **budget(ecfg)}
    else:
        every, window, protocol = protocol_jobs(ecfg, data.doc_starts)
    jobs = limit_jobs(every, ecfg.max_tokens, max_bytes=ecfg.max_bytes, token_bytes=token_bytes)
    return table, one_byte, token_bytes, jobs, window, protocol, scored_count(jobs) == scored_count(every)


def state_windows(n_win: int, most: int) -> int:
    """The windows a batch's carried state is built for: ``n_win`` rounded up to a power of two, at most ``most``
    (the longest batch's count), so that a stream's batches share a few state shapes."""
    return min(1 << (n_win - 1).bit_length(), max(most, n_win))


def state_tokens(jobs: list[Job], window: int) -> int:
    """The most tokens :func:`run_jobs` asks a state to hold for ``jobs`` (a job longer than one window runs in
    whole windows with the state carried; 0: every job fits one call, no state)."""
    return max((-(-j.n // window) * window for j in jobs if window > 0 and j.n > window), default=0)


def check_state(init_state, jobs: list[Job], *, window: int, batch_size: int, ecfg, row_bytes: int = 0) -> None:
    """Refuse in one line, before anything is scored, a protocol whose longest stream the model's state cannot
    hold (a layer's ``init_state`` raises ``ValueError``: e.g. FMA's levels built for a shorter ``max_len``). The
    state is built abstractly (``jax.eval_shape``): nothing is allocated."""
    n = state_tokens(jobs, window)
    if n == 0:
        return
    try:
        jax.eval_shape(lambda: init_state(batch_size, n))
    except ValueError as e:
        resets = f"every {row_bytes:,} bytes" if row_bytes > 0 else (
            f"eval.reset={ecfg.reset!r}, eval.row_len={ecfg.row_len}")
        raise ConfigError(f"{e} (the evaluation carries the state through {n:,} tokens: {resets}); reset it "
                          "more often (eval.row_len=N) or give the layer a state that holds the stream") from None


def score_split(forward, params, data, ecfg, *, init_state, one_token_per_byte: bool = False, tokenizer=None,
                word_count: int | None = None, progress: bool = True, desc: str = "eval", compressors: bool = False,
                row_bytes: int = 0, stop=None) -> tuple[dict, tuple]:
    """Score a prepared split (``data.tokens``, ``data.doc_starts``) under the protocol of ``ecfg``
    (a validated ``eval`` section). Returns (result, (loss sum, token count, bytes or None) per position in the
    context).

    ``tokenizer`` (lossless: :func:`byte_lengths`) adds bits per byte over the bytes of the scored tokens, the
    split's bytes (on the full split) and, with ``compressors``, gzip and xz on exactly the scored bytes;
    positions are then bytes of context. ``row_bytes`` > 0 (a lossless tokenizer): the stream protocol with the
    state reset at each document start and every ``row_bytes`` bytes inside it (:func:`byte_cut_jobs`) instead
    of ``ecfg``'s ``reset`` / ``row_len``."""
    table, one_byte, token_bytes, jobs, window, protocol, whole = split_jobs(
        data, ecfg, tokenizer=tokenizer, one_token_per_byte=one_token_per_byte, row_bytes=row_bytes)
    check_state(init_state, jobs, window=window, batch_size=ecfg.batch_size, ecfg=ecfg, row_bytes=row_bytes)
    t0 = time.time()
    nll_sum, count, pos_sum, pos_cnt, pos_bytes = run_jobs(
        forward, params, data.tokens, jobs, window=window, batch_size=ecfg.batch_size,
        init_state=init_state, progress=progress, desc=desc,
        token_bytes=None if one_byte else token_bytes, pad_to=32 if row_bytes > 0 else 0, stop=stop,
    )
    if one_byte:
        pos_bytes = pos_cnt
    # word-level perplexity divides by the split's official word count: only meaningful on the full split (no
    # budget, or one the split ends within: ``whole``)
    words = word_count if whole else None
    ids = scored_ids(data.tokens, jobs) if token_bytes is not None else None
    res = summarize(nll_sum, count, one_token_per_byte=one_byte, protocol=protocol, word_count=words,
                    bytes_scored=None if ids is None else int(table[ids].sum()))
    if token_bytes is not None and whole:
        res["bytes_in_split"] = int(token_bytes.sum())  # less bytes_scored: the documents' first tokens
    if not whole:
        res["budget"] = budget_text(ecfg)
    res["seconds"] = time.time() - t0
    if compressors and ids is not None:
        scored = ids.astype(np.uint8).tobytes() if one_byte else tokenizer.decode_bytes(ids)
        res["compressors_bits_per_byte"] = compressor_bits_per_byte(scored)
    return res, (pos_sum, pos_cnt, pos_bytes)


def split_word_count(data) -> int | None:
    """The official word count of a prepared split, where the dataset defines one."""
    counts = data.manifest.get("source", {}).get("word_counts") or {}
    return counts.get(data.manifest["split"])


# ----------------------------------------------------------------------------------------------
# encoders (masked LM): one fixed, seeded masking of the split


def mlm_rows(doc_starts, *, context: int, max_tokens: int = 0) -> np.ndarray:
    """Start offsets of the evaluation rows: consecutive, non-overlapping rows of ``context`` tokens
    inside each document, in split order (a document's last partial row is left out: an encoder
    row is always full). ``max_tokens > 0`` keeps the first ceil(max_tokens / context) rows."""
    starts = [np.arange(a, b - context + 1, context) for a, b in zip(doc_starts[:-1], doc_starts[1:])
              if b - a >= context]
    rows = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    if max_tokens > 0:
        rows = rows[: -(-max_tokens // context)]
    return rows


def mlm_protocol(ecfg, mcfg, *, context: int, n_rows: int) -> dict:
    return {
        "mode": "masked-token", "context": context, "rows": n_rows,
        "masking": mcfg.masking, "rate": mcfg.rate, "masked_per_row": num_masked(context, mcfg.rate),
        "mask_prob": mcfg.mask_prob, "random_prob": mcfg.random_prob, "mask_seed": mcfg.eval_seed,
        **({"span_len": mcfg.span_len, "max_span_len": mcfg.max_span_len} if mcfg.masking == "span" else {}),
        **({"clusters": list(mcfg.clusters), "cluster_sigma": list(mcfg.cluster_sigma)}
           if mcfg.masking == "clustered" else {}),
        "max_tokens": ecfg.max_tokens or "full split",
    }


def score_mlm_split(forward, params, data, ecfg, mcfg, *, context: int, mask_id: int, one_token_per_byte: bool,
                    replacement: dict | None = None, progress: bool = True, desc: str = "eval",
                    stop=None) -> tuple[dict, tuple]:
    """Masked-token loss and accuracy of an encoder on a prepared split.

    The split is cut into rows of ``context`` tokens (:func:`mlm_rows`); row i is masked by
    :func:`longctx.data.masking.mask_rows` with seed ``mlm.eval_seed``, step 0 and row i, so every run
    and method scores the same tokens in the same corrupted contexts, whatever the batch size. ``replacement``:
    the tokenizer's vocabulary and special ids the random replacements are drawn from
    (:func:`longctx.data.masking.replacement_vocab`; None: the ids below the mask id).
    ``forward(params, inputs, targets, mask) -> (nll, correct, valid, idx)`` ([B, M] each, at the
    masked positions). Returns (result, (loss sum, token count) by position in the row)."""

    if ecfg.max_bytes > 0:
        raise ConfigError(f"eval.max_bytes={ecfg.max_bytes} applies to decoders; an encoder's rows are counted in "
                          "tokens (eval.max_tokens)")
    rows = mlm_rows(data.doc_starts, context=context, max_tokens=ecfg.max_tokens)
    if len(rows) == 0:
        raise DataError(f"the split has no document of {context} tokens to evaluate an encoder on; "
                        "lower eval.context (or train.seq_len)")
    t0 = time.time()
    B = ecfg.batch_size
    nll_sum, count, correct_sum = 0.0, 0, 0
    pos_sum = np.zeros(context, np.float64)
    pos_cnt = np.zeros(context, np.int64)
    bar = tqdm(total=len(rows), desc=desc, unit="row", disable=not progress, leave=False)
    for b0 in range(0, len(rows), B):
        _check_stop(stop)
        idx_rows = np.arange(b0, min(b0 + B, len(rows)))
        tok = np.zeros((B, context), np.int32)
        for r, i in enumerate(idx_rows):
            tok[r] = np.asarray(data.tokens[rows[i] : rows[i] + context], np.int32)
        ids = np.concatenate([idx_rows, np.zeros(B - len(idx_rows), idx_rows.dtype)])  # padding rows: not counted
        batch = mask_rows(tok, mcfg, seed=mcfg.eval_seed, step=0, rows=ids, mask_id=mask_id, **(replacement or {}))
        batch["mask"][len(idx_rows):] = False
        nll, correct, valid, where = (np.asarray(a) for a in forward(
            params, jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"]), jnp.asarray(batch["mask"])))
        nll_sum += float(nll[valid].sum())
        count += int(valid.sum())
        correct_sum += int(correct[valid].sum())
        np.add.at(pos_sum, where[valid], nll[valid])
        np.add.at(pos_cnt, where[valid], 1)
        bar.update(len(idx_rows))
    bar.close()
    protocol = mlm_protocol(ecfg, mcfg, context=context, n_rows=len(rows))
    res = summarize(nll_sum, count, one_token_per_byte=one_token_per_byte, protocol=protocol)
    res["accuracy"] = correct_sum / max(count, 1)
    res["scored"] = "masked tokens"
    res["seconds"] = time.time() - t0
    return res, (pos_sum, pos_cnt)


# ----------------------------------------------------------------------------------------------
# generated recall tasks (longctx.data.synthetic): answers scored by distance


def score_answers(forward, params, rows: dict, edges: np.ndarray, *, window: int, batch_size: int, init_state,
                  progress: bool = True, desc: str = "recall", stop=None) -> dict:
    """Exact match and loss of the answers of generated rows, overall and by distance bin.

    ``rows``: :func:`longctx.data.synthetic.pack`'s arrays (tokens [N, L+1], answer [N, L] = the
    answer's index in its row or -1, distance [N, A]); ``edges``: the bin edges (bin i holds
    distances in [edges[i], edges[i+1])). ``forward(params, inputs, targets, state) -> (nll, correct,
    state)`` ([B, W] each); rows longer than ``window`` (> 0) run in windows with the state carried
    (``init_state(B, L)``), so any method reads the context through its own state. An answer is
    correct when every one of its tokens is the argmax prediction given the true prefix (= greedy
    decoding reproduces it)."""
    tokens, answer, distance = rows["tokens"], rows["answer"], rows["distance"]
    N, L = answer.shape
    A = distance.shape[1]
    ans_nll = np.zeros((N, A), np.float64)
    ans_len = np.zeros((N, A), np.int64)
    ans_ok = np.ones((N, A), bool)
    n_win = -(-L // window) if 0 < window < L else 1
    width = n_win * window if n_win > 1 else L
    t0 = time.time()
    bar = tqdm(total=N, desc=desc, unit="row", disable=not progress, leave=False)
    for b0 in range(0, N, batch_size):
        idx = np.arange(b0, min(b0 + batch_size, N))
        inputs = np.zeros((batch_size, width), np.int32)
        targets = np.zeros((batch_size, width), np.int32)
        inputs[: len(idx), :L] = tokens[idx, :-1]
        targets[: len(idx), :L] = tokens[idx, 1:]
        state = None if n_win == 1 else init_state(batch_size, width)
        nlls, oks = [], []
        for w in range(n_win):
            _check_stop(stop)
            sl = slice(w * window, (w + 1) * window) if n_win > 1 else slice(0, width)
            nll_w, ok_w, state = forward(params, jnp.asarray(inputs[:, sl]), jnp.asarray(targets[:, sl]), state)
            nlls.append(np.asarray(nll_w))
            oks.append(np.asarray(ok_w))
        nll = np.concatenate(nlls, axis=1)[: len(idx), :L]
        ok = np.concatenate(oks, axis=1)[: len(idx), :L]
        r, t = np.nonzero(answer[idx] >= 0)
        a = answer[idx][r, t]
        np.add.at(ans_nll, (idx[r], a), nll[r, t])
        np.add.at(ans_len, (idx[r], a), 1)
        np.logical_and.at(ans_ok, (idx[r], a), ok[r, t])
        bar.update(len(idx))
    bar.close()
    have = distance >= 0
    d, nll_sum, n_tok, ok = distance[have], ans_nll[have], ans_len[have], ans_ok[have]
    bins = []
    for i in range(len(edges) - 1):
        sel = (d >= edges[i]) & (d < edges[i + 1])
        bins.append({
            "lo": int(edges[i]), "hi": int(edges[i + 1]) - 1, "answers": int(sel.sum()),
            "accuracy": float(ok[sel].mean()) if sel.any() else None,
            "loss_nats_per_token": float(nll_sum[sel].sum() / max(n_tok[sel].sum(), 1)) if sel.any() else None,
        })
    tok = int(n_tok.sum())
    return {
        "answers": int(have.sum()), "tokens_scored": tok,
        "accuracy": float(ok.mean()) if ok.size else 0.0,
        "loss_nats_per_token": float(nll_sum.sum() / max(tok, 1)),
        "bits_per_token": float(nll_sum.sum() / max(tok, 1) / LN2),
        "by_distance": bins, "seconds": time.time() - t0,
        "protocol": {"mode": "answers-by-distance", "row_len": int(L), "rows": int(N),
                     "window": int(window) if n_win > 1 else int(L), "state_carried": n_win > 1,
                     "scored": "answer tokens (exact match: every token the argmax given the true prefix)"},
    }
