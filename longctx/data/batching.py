"""Stateless batching: the batch of step s is a pure function of (seed, s).

Each row is ``row_len`` consecutive tokens taken from inside one document
(documents shorter than ``row_len`` are not used for training), so no row ever
mixes two documents and resuming at step s reproduces the run exactly.
"""

from __future__ import annotations

import numpy as np

from longctx.data.prepare import TokenData
from longctx.errors import DataError


class Batcher:
    def __init__(self, data: TokenData, *, row_len: int, batch_size: int, seed: int, shard: tuple[int, int] = (0, 1)):
        self.data, self.row_len, self.batch_size, self.seed = data, row_len, batch_size, seed
        self.shard_index, self.num_shards = shard
        starts, ends = data.doc_starts[:-1], data.doc_starts[1:]
        n_valid = np.maximum(ends - starts - row_len + 1, 0)
        keep = n_valid > 0
        self.doc_first = starts[keep]
        self.cum = np.concatenate([[0], np.cumsum(n_valid[keep])])
        self.doc_index = np.nonzero(keep)[0]
        if self.cum[-1] == 0:
            longest = int((ends - starts).max(initial=0))
            raise DataError(
                f"no document has {row_len} tokens (longest: {longest}); lower train.seq_len or use a corpus with longer documents"
            )
        self.tokens_usable = int((ends - starts)[keep].sum())

    def row_starts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        flat = rng.integers(0, self.cum[-1], size=self.batch_size)
        which = np.searchsorted(self.cum, flat, side="right") - 1
        return self.doc_first[which] + (flat - self.cum[which]), self.doc_index[which]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """{'tokens': [B_local, row_len] int32, 'doc_ids': [B_local] int32} for this host's shard."""
        starts, docs = self.row_starts(step)
        lo = self.shard_index * self.batch_size // self.num_shards
        hi = (self.shard_index + 1) * self.batch_size // self.num_shards
        starts, docs = starts[lo:hi], docs[lo:hi]
        idx = starts[:, None] + np.arange(self.row_len)[None, :]
        return {"tokens": np.asarray(self.data.tokens[idx], dtype=np.int32), "doc_ids": docs.astype(np.int32)}
