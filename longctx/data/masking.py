"""Masked-language-model corruption as a pure function of (seed, step, row).

The masks of row r at step s depend only on (seed, s, r) (a NumPy generator seeded with them),
never on the batch size, the host, or what ran before, so a resumed run draws the same masks as
an uninterrupted one, and evaluation uses one fixed masking of the split (``mlm.eval_seed``,
row = the row's index in the split).

Each row of T tokens gets exactly ``num_masked(T, mlm.rate)`` predicted positions (a static count,
so the loss gathers them by index). Which positions, by ``mlm.masking``:

* ``bert``: uniformly at random without replacement (BERT: rate 0.15).
* ``span``: contiguous spans at random starts, lengths geometric with mean ``mlm.span_len`` and
  at most ``mlm.max_span_len`` (SpanBERT-style), until the count is reached (the last span is cut).
* ``clustered``: VCC's pretraining masking (docs/methods/vcc.md §3.2): a number of centres
  uniform in ``mlm.clusters`` and a width sigma uniform in ``mlm.cluster_sigma`` are drawn per row;
  a position's weight is the mean over centres of exp(-(t - c)^2 / (2 sigma^2)), and the positions
  are drawn by weight without replacement (Gumbel top-k). (VCC's collator also shuffles 8-32
  document segments of a row; rows here are one contiguous piece of the split, unshuffled.)

A row of ``data.packing='segments'`` (several documents, :func:`with_boundaries`) is masked like any other: the
positions are drawn over the whole row whatever its documents (a document's share of the masked tokens
varies), and the encoder sees each document alone.

Then each predicted position's input is replaced by the mask token with probability
``mlm.mask_prob``, by a uniformly random text token with probability ``mlm.random_prob``, and left
unchanged otherwise (BERT's 80/10/10). The mask token id is ``mask_id``: one beyond the
tokenizer's vocabulary, or an imported encoder's own mask token (:func:`own_mask_id`:
:func:`longctx.config.resolve_vocab`). Random tokens are drawn uniformly from the tokenizer's vocabulary
``[0, vocab_size)`` less the mask id and the tokenizer's special ids (:func:`replacement_ids`; BERT draws from its
whole vocabulary, special tokens included); without a vocabulary size, from the ids below the mask id (the byte
default: mask id 256, the last id, no other special id, which is the same set and the same draws).
"""

from __future__ import annotations

import numpy as np

from longctx.errors import ConfigError

SCHEMES = ("bert", "span", "clustered")
_SALT = 0x4D4C4D  # separates the masking stream from the batcher's (seed, step) stream


MASK_TOKENS = ("<mask>", "[MASK]")  # a tokenizer's own mask token: RoBERTa's, BERT's


def own_mask_id(tokenizer) -> int | None:
    """The id of the tokenizer's own mask token (the first of :data:`MASK_TOKENS` in a Hugging Face
    ``tokenizer.json``'s vocabulary), or None (no such token, or a tokenizer of another kind)."""
    tok = getattr(tokenizer, "tok", None)
    token_to_id = getattr(tok, "token_to_id", None)
    if token_to_id is None:
        return None
    return next((int(i) for i in map(token_to_id, MASK_TOKENS) if i is not None), None)


def special_ids(tokenizer) -> tuple[int, ...]:
    """The ids of the tokenizer's special tokens (a Hugging Face ``tokenizer.json``'s added tokens marked special:
    BERT's ``[PAD]`` ``[UNK]`` ``[CLS]`` ``[SEP]`` ``[MASK]``, RoBERTa's ``<s>`` ``<pad>`` ``</s>`` ``<unk>``
    ``<mask>``), sorted; () for a tokenizer of another kind (bytes: every id is a byte of text)."""
    added = getattr(getattr(tokenizer, "tok", None), "get_added_tokens_decoder", None)
    if added is None:
        return ()
    return tuple(sorted(int(i) for i, t in added().items() if getattr(t, "special", False)))


def replacement_vocab(tokenizer) -> dict:
    """``vocab_size`` and ``special_ids`` of :func:`mask_rows` for ``tokenizer`` (its ``vocab_size``, its
    :func:`special_ids`); {} for no tokenizer (the ids below the mask id)."""
    if tokenizer is None:
        return {}
    return {"vocab_size": int(tokenizer.vocab_size), "special_ids": special_ids(tokenizer)}


def text_ids(tokenizer, mask_id: int, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool (``model.vocab_size``, the logits' width): the ids an encoder may put in place of a masked
    token, the tokenizer's ids (``[0, tokenizer.vocab_size)``) less ``mask_id`` (wherever it is: one beyond the
    vocabulary, RoBERTa's last id, BERT's 103) and the tokenizer's other special tokens (:func:`special_ids`); the
    ids a larger table holds beyond the tokenizer's vocabulary are never text."""
    ok = np.zeros(int(vocab_size), bool)
    ok[: min(int(tokenizer.vocab_size), int(vocab_size))] = True
    for i in (int(mask_id), *special_ids(tokenizer)):
        if 0 <= i < len(ok):
            ok[i] = False
    return ok


def num_masked(row_len: int, rate: float) -> int:
    """Predicted positions per row: round(rate * row_len), at least 1 and at most row_len."""
    return int(min(row_len, max(1, round(rate * row_len))))


def row_rng(seed: int, step: int, row: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(step), int(row), _SALT])


def _bert_positions(rng, T: int, n: int) -> np.ndarray:
    return rng.choice(T, size=n, replace=False)


def _span_positions(rng, T: int, n: int, mean_len: float, max_len: int) -> np.ndarray:
    covered = np.zeros(T, bool)
    count = 0
    for _ in range(16 * T):  # enough for any n <= T in practice; the fallback below finishes the rest
        if count >= n:
            break
        length = int(min(rng.geometric(1.0 / mean_len), max_len, T))
        start = int(rng.integers(0, T - length + 1))
        new = np.flatnonzero(~covered[start : start + length]) + start
        new = new[: n - count]
        covered[new] = True
        count += len(new)
    if count < n:
        free = np.flatnonzero(~covered)
        covered[rng.choice(free, size=n - count, replace=False)] = True
    return np.flatnonzero(covered)


def _clustered_positions(rng, T: int, n: int, clusters, sigma) -> np.ndarray:
    n_centres = int(rng.integers(int(clusters[0]), int(clusters[1]) + 1))
    width = float(rng.uniform(float(sigma[0]), float(sigma[1])))
    centres = rng.integers(0, T, size=n_centres).astype(np.float64)
    t = np.arange(T, dtype=np.float64)
    weight = np.exp(-((t[:, None] - centres[None, :]) ** 2) / (2.0 * width**2)).mean(axis=1)
    scores = np.log(weight + 1e-6) + rng.gumbel(size=T)
    return np.argsort(-scores, kind="stable")[:n]


def choose_positions(rng, T: int, mcfg) -> np.ndarray:
    """Sorted predicted positions of one row of ``T`` tokens (``num_masked(T, mcfg.rate)`` of them)."""
    n = num_masked(T, mcfg.rate)
    if mcfg.masking == "bert":
        pos = _bert_positions(rng, T, n)
    elif mcfg.masking == "span":
        pos = _span_positions(rng, T, n, float(mcfg.span_len), int(mcfg.max_span_len))
    elif mcfg.masking == "clustered":
        pos = _clustered_positions(rng, T, n, mcfg.clusters, mcfg.cluster_sigma)
    else:
        raise ConfigError(f"mlm.masking={mcfg.masking!r} is unknown; allowed: {', '.join(SCHEMES)}")
    return np.sort(pos)


def replacement_ids(mask_id: int, vocab_size: int | None = None, special_ids=()) -> np.ndarray:
    """The sorted int64 ids a random replacement is drawn from: ``[0, vocab_size)`` (the tokenizer's vocabulary,
    ``tokenizer.vocab_size``) less ``mask_id`` and ``special_ids`` (:func:`special_ids`: pad, cls, sep, bos, eos,
    unk, ...); ``vocab_size`` None: ``[0, mask_id)``, less ``special_ids``."""
    vocab = int(mask_id) if vocab_size is None else int(vocab_size)
    keep = np.ones(max(vocab, 0), bool)
    for i in (int(mask_id), *map(int, special_ids)):
        if 0 <= i < vocab:
            keep[i] = False
    return np.flatnonzero(keep)


def corrupt_row(rng, row: np.ndarray, positions: np.ndarray, mcfg, mask_id: int,
                replace_ids: np.ndarray | None = None) -> np.ndarray:
    """The input row: predicted positions -> mask token / random token / unchanged (80/10/10). The random tokens
    are drawn uniformly from ``replace_ids`` (:func:`replacement_ids`; None: the ids below ``mask_id``)."""
    out = np.array(row, np.int32, copy=True)
    u = rng.random(len(positions))
    to_mask = positions[u < mcfg.mask_prob]
    to_random = positions[(u >= mcfg.mask_prob) & (u < mcfg.mask_prob + mcfg.random_prob)]
    out[to_mask] = mask_id
    if replace_ids is None:
        replace_ids = replacement_ids(mask_id)
    # an index into the sorted ids: where they are [0, mask_id) the draws are rng.integers(0, mask_id)'s own
    out[to_random] = replace_ids[rng.integers(0, len(replace_ids), size=len(to_random))]
    return out


def mask_rows(tokens: np.ndarray, mcfg, *, seed: int, step: int, rows, mask_id: int, vocab_size: int | None = None,
              special_ids=()) -> dict[str, np.ndarray]:
    """Corrupt a batch of rows.

    tokens: [B, T] int token ids; rows: the B global row indices (``row0 + arange(B)`` for a
    host's shard of a training batch, the row's index in the split for evaluation). ``vocab_size`` (the
    tokenizer's) and ``special_ids`` (its special tokens, :func:`special_ids`) give the ids random replacements are
    drawn from (:func:`replacement_ids`; ``vocab_size`` None: the ids below ``mask_id``).
    Returns {'inputs': [B, T] int32 corrupted ids, 'targets': [B, T] int32 (= tokens),
    'mask': [B, T] bool predicted positions}.
    """
    tokens = np.asarray(tokens, np.int32)
    B, T = tokens.shape
    rows = np.asarray(rows)
    if rows.shape != (B,):
        raise ValueError(f"rows must hold one index per row ({B}), got shape {rows.shape}")
    replace = replacement_ids(mask_id, vocab_size, special_ids)
    inputs = np.empty_like(tokens)
    mask = np.zeros((B, T), bool)
    for b in range(B):
        rng = row_rng(seed, step, int(rows[b]))
        pos = choose_positions(rng, T, mcfg)
        mask[b, pos] = True
        inputs[b] = corrupt_row(rng, tokens[b], pos, mcfg, mask_id, replace)
    return {"inputs": inputs, "targets": tokens, "mask": mask}


BOUNDARIES = ("segment_ids", "positions")  # a packed row's arrays (longctx.data.batching, packing='segments')


def with_boundaries(masked: dict[str, np.ndarray], batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`mask_rows`'s output plus the batcher's 'segment_ids' and 'positions' [B, T] where ``batch`` (the rows
    it masked) has them (``data.packing='segments'``), unchanged; ``masked`` itself otherwise."""
    extra = {k: np.asarray(batch[k], np.int32) for k in BOUNDARIES if k in batch}
    if extra and any(v.shape != masked["inputs"].shape for v in extra.values()):
        raise ValueError(f"segment ids / positions {[v.shape for v in extra.values()]} must be like the rows "
                         f"{masked['inputs'].shape}")
    return {**masked, **extra}
