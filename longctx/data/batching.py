"""Stateless batching: the batch of step s is a pure function of (seed, s).

Three rules for cutting rows of ``row_len`` tokens from a split's token stream (``data.packing``):

- ``'document'`` (default): each row lies inside one document, so no row mixes two documents;
  documents shorter than ``row_len`` are not trained on (:meth:`Batcher.summary` says how many
  tokens that skips);
- ``'pack'`` (GPT-style): a row is any ``row_len`` consecutive tokens of the split, so it runs
  across document boundaries; documents follow each other separated by the tokenizer's
  end-of-document token (where it has one: ``sentencepiece``, ``hf``, ``words``; ``bytes`` has
  none), and the model's state is not reset inside a row. Every token can be trained on.
- ``'segments'``: the rows of ``'pack'`` (documents back to back, no token skipped) with their boundaries
  carried beside the tokens: ``segment_ids`` [B, row_len] int32 (1, 2, 3, ... for the documents of a row, in
  order) and ``positions`` [B, row_len] int32 (0 at each document's first token in the row). The model
  attends only within a document and restarts its positions and carried state at each boundary, so each
  document is trained on as if it were alone. A row's first piece starts afresh at position 0 even where its
  document began in an earlier row: a document longer than a row, or one a row starts inside, is trained on
  as independent pieces (its later pieces without the context of the earlier ones). Every token can be
  trained on. Refused for a split that is one document (nothing to keep apart). Every attention method takes
  segment ids; ``'document'`` stays the default for now because switching changes every config's data (the
  published runs among them) and needs a per-source rule (a one-document corpus such as enwik8 refuses it).

Row starts are drawn uniformly among the allowed positions, so resuming at step s reproduces the
run exactly.
"""

from __future__ import annotations

import numpy as np

from longctx.data.prepare import TokenData
from longctx.errors import DataError

PACKING = ("document", "pack", "segments")


def row_segments(doc_starts: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment ids, positions), each like ``idx`` [B, L] (stream indices of consecutive tokens per row): the
    documents of each row numbered 1, 2, 3, ... and each token's position in its document's piece of the row
    (0 at the row's first token and at every document start)."""
    doc = np.searchsorted(doc_starts, idx, side="right") - 1
    new = np.ones(idx.shape, bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    seg = np.cumsum(new, axis=1)
    start = np.maximum.accumulate(np.where(new, np.arange(idx.shape[1])[None, :], 0), axis=1)
    return seg.astype(np.int32), (np.arange(idx.shape[1])[None, :] - start).astype(np.int32)


class Batcher:
    def __init__(self, data: TokenData, *, row_len: int, batch_size: int, seed: int, shard: tuple[int, int] = (0, 1),
                 packing: str = "document"):
        if packing not in PACKING:
            raise DataError(f"data.packing={packing!r}; allowed: {', '.join(PACKING)}")
        self.data, self.row_len, self.batch_size, self.seed = data, row_len, batch_size, seed
        self.packing = packing
        self.shard_index, self.num_shards = shard
        starts, ends = data.doc_starts[:-1], data.doc_starts[1:]
        lengths = ends - starts
        long_enough = lengths >= row_len
        self.tokens_total = int(data.num_tokens)
        self.tokens_in_long_docs = int(lengths[long_enough].sum())  # what the 'document' rule trains on
        self.short_docs = int((~long_enough).sum())
        if packing == "segments" and data.num_docs < 2:
            raise DataError(f"data.packing='segments' keeps documents apart, but the train split is one document of "
                            f"{self.tokens_total:,} tokens (no boundaries); use data.packing=pack or document")
        if packing in ("pack", "segments"):
            if self.tokens_total < row_len:
                raise DataError(f"the train split has {self.tokens_total} tokens, fewer than one row of {row_len}; "
                                "lower train.seq_len or use a larger corpus")
            self.doc_first = np.zeros(1, np.int64)
            self.cum = np.asarray([0, self.tokens_total - row_len + 1], np.int64)
            self.doc_index = np.zeros(1, np.int64)
            self.tokens_usable = self.tokens_total
            return
        n_valid = np.maximum(lengths - row_len + 1, 0)
        keep = n_valid > 0
        self.doc_first = starts[keep]
        self.cum = np.concatenate([[0], np.cumsum(n_valid[keep])])
        self.doc_index = np.nonzero(keep)[0]
        if self.cum[-1] == 0:
            longest = int(lengths.max(initial=0))
            raise DataError(
                f"no document has {row_len} tokens (longest: {longest}); lower train.seq_len, set data.packing=pack "
                "(rows across documents) or use a corpus with longer documents"
            )
        self.tokens_usable = self.tokens_in_long_docs

    def summary(self) -> str:
        """The packing rule and how many train tokens each rule trains on / skips."""
        n, L = self.tokens_total, self.row_len
        pct = lambda k: 100.0 * k / max(n, 1)
        doc = self.tokens_in_long_docs
        skipped = f"skips {n - doc:,} in {self.short_docs:,} documents shorter than {L} tokens"
        if self.packing == "segments":
            return (f"packing='segments' (rows of {L} tokens of consecutive documents, each attended alone: segment "
                    f"ids and positions restart at every document; a row's first piece starts afresh): trains on "
                    f"{n:,} of {n:,} train tokens (100.00 %); packing='document' would train on {doc:,} "
                    f"({pct(doc):.2f} %) and {skipped}")
        if self.packing == "pack":
            eos = self.data.manifest.get("eos_id")
            sep = f"end-of-document token {eos}" if eos is not None else "no separator token (the tokenizer has none)"
            return (f"packing='pack' (rows of {L} tokens across documents, {sep}): trains on {n:,} of {n:,} train "
                    f"tokens (100.00 %); packing='document' would train on {doc:,} ({pct(doc):.2f} %) and {skipped}")
        return (f"packing='document' (each row of {L} tokens inside one document): trains on {doc:,} of {n:,} train "
                f"tokens ({pct(doc):.2f} %), {skipped}; data.packing=pack would train on all {n:,} (100.00 %)")

    def row_starts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        flat = rng.integers(0, self.cum[-1], size=self.batch_size)
        which = np.searchsorted(self.cum, flat, side="right") - 1
        starts = self.doc_first[which] + (flat - self.cum[which])
        if self.packing in ("pack", "segments"):  # the document the row starts in
            return starts, np.searchsorted(self.data.doc_starts, starts, side="right") - 1
        return starts, self.doc_index[which]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """{'tokens': [B_local, row_len] int32, 'doc_ids': [B_local] int32} for this host's shard; with
        ``packing='segments'`` also 'segment_ids' and 'positions' [B_local, row_len] int32 (:func:`row_segments`)."""
        starts, docs = self.row_starts(step)
        lo = self.shard_index * self.batch_size // self.num_shards
        hi = (self.shard_index + 1) * self.batch_size // self.num_shards
        starts, docs = starts[lo:hi], docs[lo:hi]
        idx = starts[:, None] + np.arange(self.row_len)[None, :]
        out = {"tokens": np.asarray(self.data.tokens[idx], dtype=np.int32), "doc_ids": docs.astype(np.int32)}
        if self.packing == "segments":
            out["segment_ids"], out["positions"] = row_segments(self.data.doc_starts, idx)
        return out
