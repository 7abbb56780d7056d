"""Synthetic recall tasks, generated on the fly: a row is a pure function of (seed, step, row, split).

Three sources, selected as ``data.source`` like any other (settings in ``data.synthetic``), all on
byte ids (vocabulary 256, the ``bytes`` tokenizer), nothing downloaded:

* ``mqar`` (multi-query associative recall, Zoology's MQAR with every key queried at most once):
  ``num_pairs`` key-value pairs ``k v`` open the row (keys distinct, ids ``[0, num_keys)``; values ids
  ``num_keys + [0, num_values)``), then ``num_queries`` of those keys reappear, each followed by its
  value, at random 2-token slots of the rest of the row; the other positions are random filler ids
  (above the keys' and values', disjoint from them). Scored: each queried value. With
  ``fused_pairs`` each pair is one token (id ``key * num_values + value``, below the key and value
  ids), so one attention layer can retrieve it by content, where the two-token form needs an
  induction circuit (much slower to learn).
* ``passkey`` (needle retrieval): a window of the built-in corpus (Python sources, the split's token
  file) as filler, the needle ``\\npass_key = DDDDD\\n`` inside it, and the row ends with the query
  ``\\npass_key = DDDDD``. Scored: the ``passkey_len`` digits of the query.
* ``copy``: a random segment of ``copy_len`` ids in ``[0, copy_vocab)`` inside random filler ids in
  ``[copy_vocab, 255)``; the row ends with the marker id 255 and the segment again. Scored: the
  repeated segment.

The **distance** of an answer is the number of tokens between its first answer token and the earlier
occurrence of that token it has to be recalled from (the value in the key-value block, the needle's
first digit, the segment's first token). ``passkey`` and ``copy`` place it: training draws it uniformly
in ``data.synthetic.distance`` (``(0, 0)``: every distance that fits the row); evaluation spreads the
rows evenly over ``data.synthetic.bins`` distance bins. ``mqar`` measures it (queries land anywhere
after the key-value block).

A row of ``row_len`` inputs is ``row_len + 1`` tokens; target ``t`` is token ``t + 1``. ``weights``
marks the scored targets (1.0 exactly at the answer tokens, 0.0 elsewhere): the trainer's loss is the
weighted mean of the per-token NLL, so only the answers are learned. Rows depend only on
(seed, step, row, split) through one NumPy generator, never on the batch size or the host, so a
resumed run sees the same rows as an uninterrupted one; evaluation uses ``eval_seed``, step 0 and the
row's index, on the ``valid`` / ``test`` stream (training rows come from the ``train`` stream).

**Packed examples** (``data.packing='segments'`` with ``data.synthetic.example_len = E > 0``): a training
row of ``row_len`` inputs holds ``k = (row_len + 1) // (E + 1)`` independent examples back to back (at
least two), each made as the row of a shorter ``make_row`` call, the row's ``row_len + 1`` tokens shared
between them as evenly as possible (each example at least ``E + 1`` tokens, i.e. ``E`` inputs). Beside the
tokens the batch carries ``segment_ids`` (1 .. k) and ``positions`` (0 at each example's first token),
``[B, row_len + 1]`` int32 like the prepared corpora's packed rows (:mod:`longctx.data.batching`), so the
model attends within each example and no example sees another; the weights mark only the answers (the
target that crosses into the next example is never one). The examples of a row come one after the other
from the row's one generator, so a packed row is still a pure function of (seed, step, row, split).
Evaluation scores examples alone: the fixed evaluation rows are single examples of ``E`` inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from longctx.data import builtin
from longctx.data.prepare import prepare
from longctx.errors import ConfigError, DataError

VOCAB = 256  # byte ids
_SALT = 0x52434C  # separates the rows' generator stream from the batcher's and the masking's
_SPLITS = {"train": 0, "valid": 1, "test": 2}
NEEDLE_PREFIX = b"\npass_key = "
COPY_MARKER = VOCAB - 1


def row_rng(seed: int, step: int, row: int, split: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(step), int(row), _SALT, _SPLITS[split]])


@dataclasses.dataclass
class Row:
    """One generated row: ``tokens`` [L + 1]; answers as (first target index, length, distance)."""

    tokens: np.ndarray
    answers: list[tuple[int, int, int]]


def pack(rows: list[Row], row_len: int, max_answers: int) -> dict[str, np.ndarray]:
    """Rows -> the batch arrays: tokens [B, L + 1] int32, weights [B, L] float32 (1 at answer tokens),
    answer [B, L] int32 (the answer's index in its row, -1 elsewhere), distance [B, A] int32 (-1: none)."""
    B = len(rows)
    tokens = np.stack([r.tokens for r in rows]).astype(np.int32)
    weights = np.zeros((B, row_len), np.float32)
    answer = np.full((B, row_len), -1, np.int32)
    distance = np.full((B, max_answers), -1, np.int32)
    for b, r in enumerate(rows):
        for i, (t, n, d) in enumerate(r.answers):
            weights[b, t : t + n] = 1.0
            answer[b, t : t + n] = i
            distance[b, i] = d
    return {"tokens": tokens, "weights": weights, "answer": answer, "distance": distance}


class SyntheticSource:
    """Base of the generated sources: ``generated = True`` tells the trainer and the evaluation to ask
    it for rows instead of preparing token files."""

    generated = True
    splits = ("train", "valid", "test")
    default_tokenizer = "bytes"
    name = "synthetic"

    #: a training row can hold several independent examples (``data.packing='segments'``, module docstring)
    packs_examples = True

    def __init__(self, data_cfg):
        self.data_cfg = data_cfg
        self.s = data_cfg.synthetic
        # the inputs of one example in a packed row (0: each row is one example)
        self.example_len = int(self.s.get("example_len", 0)) if data_cfg.get("packing") in ("segments", "auto") else 0
        if self.example_len < 0:
            raise ConfigError(f"data.synthetic.example_len={self.example_len} must be >= 0 (0: one example a row)")
        if data_cfg.tokenizer != "bytes":
            raise ConfigError(f"data.source={self.name!r} generates byte ids; set data.tokenizer='bytes'")

    # -- what a subclass provides ------------------------------------------------------------------
    def max_answers(self, row_len: int) -> int:
        raise NotImplementedError

    def distance_range(self, row_len: int) -> tuple[int, int]:
        """The (shortest, longest) answer distance a row of ``row_len`` inputs can hold."""
        raise NotImplementedError

    def make_row(self, rng, row_len: int, split: str, distance: int | None) -> Row:
        raise NotImplementedError

    controls_distance = True  # False: the distance is measured, not placed (mqar)

    # -- shared ------------------------------------------------------------------------------------
    def options(self) -> dict:
        return {}

    def metadata(self) -> dict:
        meta = {"source": self.name, "generated": True, **self.options()}
        meta["content_hash"] = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
        return meta

    def train_distances(self, row_len: int) -> tuple[int, int]:
        """The training distance range: ``data.synthetic.distance`` with 0 ends filled in, checked."""
        lo, hi = self.distance_range(row_len)
        want = tuple(int(x) for x in self.s.distance)
        a = want[0] or lo
        b = want[1] or hi
        if not lo <= a <= b <= hi:
            raise ConfigError(f"data.synthetic.distance={want} does not fit rows of {row_len} tokens for "
                              f"data.source={self.name!r}: distances from {lo} to {hi} fit (0 = that end)")
        return a, b

    def check(self, row_len: int) -> None:
        """Raise ConfigError unless rows of ``row_len`` inputs hold the task as configured."""
        self.distance_range(row_len)
        if self.controls_distance:
            self.train_distances(row_len)

    def example_lengths(self, row_len: int) -> np.ndarray:
        """The token counts of the examples a packed row of ``row_len`` inputs holds (module docstring): the
        row's ``row_len + 1`` tokens shared as evenly as possible between ``(row_len + 1) // (example_len + 1)``
        examples. ConfigError (one line) where fewer than two fit."""
        n, e = row_len + 1, self.example_len + 1
        k = n // e
        if k < 2:
            raise ConfigError(f"data.synthetic.example_len={self.example_len}: rows of {row_len} inputs hold {k} "
                              f"example(s) of {e} tokens; packing needs at least 2 (lower example_len or raise the "
                              "row length)")
        return np.full(k, n // k, np.int64) + (np.arange(k) < n % k)

    def check_rows(self, row_len: int) -> None:
        """Raise ConfigError unless training rows of ``row_len`` inputs hold the task as configured: one example
        each, or (packed) at least two examples of ``example_len`` inputs or more (what fits the shortest fits the
        longer: every length check here grows with the row)."""
        if not self.example_len:
            return self.check(row_len)
        self.example_lengths(row_len)
        self.check(self.example_len)

    def _example(self, rng, row_len: int, split: str, distance=None) -> Row:
        """One example of ``row_len`` inputs from ``rng``: its answer at ``distance`` (sources that place it;
        None: drawn from ``rng`` in the training range)."""
        d = None
        if self.controls_distance:
            if distance is None:
                lo, hi = self.train_distances(row_len)
                distance = rng.integers(lo, hi + 1)
            d = int(distance)
        return self.make_row(rng, row_len, split, d)

    def rows(self, *, seed: int, step: int, rows, row_len: int, split: str = "train",
             distances=None) -> dict[str, np.ndarray]:
        """The batch of global row indices ``rows`` at ``step``: :func:`pack`'s arrays, one example a row.
        ``distances`` (one per row, or None): place each answer at that distance (sources that
        control it); None draws it from the training range."""
        rows = np.asarray(rows)
        if self.controls_distance and distances is None:
            self.train_distances(row_len)  # a range that does not fit fails before any row is made
        out = [self._example(row_rng(seed, step, int(r), split), row_len, split,
                             None if distances is None else distances[i]) for i, r in enumerate(rows)]
        return pack(out, row_len, self.max_answers(row_len))

    def packed_rows(self, *, seed: int, step: int, rows, row_len: int, split: str = "train") -> dict[str, np.ndarray]:
        """Packed rows (module docstring): :func:`pack`'s arrays over the whole row (answers indexed in the row,
        the row's examples' answers one after the other) and ``segment_ids`` / ``positions`` [B, row_len + 1]
        int32 (1 .. k; 0 at each example's first token)."""
        lengths = self.example_lengths(row_len)
        out = []
        for r in np.asarray(rows):
            rng = row_rng(seed, step, int(r), split)
            parts, answers, at = [], [], 0
            for n in lengths:
                ex = self._example(rng, int(n) - 1, split)
                parts.append(ex.tokens)
                answers += [(at + t, m, d) for t, m, d in ex.answers]
                at += int(n)
            out.append(Row(np.concatenate(parts), answers))
        batch = pack(out, row_len, sum(self.max_answers(int(n) - 1) for n in lengths))
        seg = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        batch["segment_ids"] = np.broadcast_to(seg, batch["tokens"].shape).copy()
        batch["positions"] = np.broadcast_to(pos, batch["tokens"].shape).copy()
        return batch

    def eval_rows(self, *, row_len: int, n_rows: int, bins: int, split: str, seed: int,
                  distance: tuple[int, int] = (0, 0)) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The fixed evaluation set: ``n_rows`` rows (seed ``seed``, step 0, row i) and the bin edges.
        Sources that place the distance spread the rows evenly over ``bins`` equal-width bins of
        ``distance`` (0 ends: the whole range that fits); mqar bins the measured distances over
        [1, row_len]."""
        lo, hi = self.distance_range(row_len)
        lo, hi = (int(distance[0]) or lo), (int(distance[1]) or hi)
        if not self.controls_distance:
            edges = np.unique(np.linspace(1, row_len + 1, bins + 1).round().astype(np.int64))
            return self.rows(seed=seed, step=0, rows=np.arange(n_rows), row_len=row_len, split=split), edges
        if not self.distance_range(row_len)[0] <= lo <= hi <= self.distance_range(row_len)[1]:
            raise ConfigError(f"distances {lo}..{hi} do not fit rows of {row_len} tokens for {self.name!r} "
                              f"(allowed {self.distance_range(row_len)})")
        edges = np.unique(np.linspace(lo, hi + 1, bins + 1).round().astype(np.int64))
        nb = len(edges) - 1
        d = np.empty(n_rows, np.int64)
        for i in range(n_rows):  # row i -> bin i % nb, uniform inside it (its own generator)
            b = i % nb
            d[i] = np.random.default_rng([int(seed), i, _SALT, 7]).integers(edges[b], edges[b + 1])
        return self.rows(seed=seed, step=0, rows=np.arange(n_rows), row_len=row_len, split=split, distances=d), edges


class MQARSource(SyntheticSource):
    name = "mqar"
    controls_distance = False

    def __init__(self, data_cfg):
        super().__init__(data_cfg)
        s = self.s
        self.n_pairs, self.n_keys, self.n_values = int(s.num_pairs), int(s.num_keys), int(s.num_values)
        self.n_queries = int(s.num_queries) or self.n_pairs
        self.fused = bool(s.fused_pairs)
        # ids: [pair ids (fused: num_keys * num_values)] keys, values, filler
        self.n_pair_ids = self.n_keys * self.n_values if self.fused else 0
        self.key0 = self.n_pair_ids
        self.value0 = self.key0 + self.n_keys
        self.filler = (self.value0 + self.n_values, VOCAB)
        if self.n_pairs < 1 or self.n_pairs > self.n_keys:
            raise ConfigError(f"data.synthetic.num_pairs={self.n_pairs} must be in [1, num_keys={self.n_keys}] "
                              "(keys are distinct within a row)")
        if not 1 <= self.n_queries <= self.n_pairs:
            raise ConfigError(f"data.synthetic.num_queries={self.n_queries} must be in [1, num_pairs={self.n_pairs}] "
                              "(0 = num_pairs; each key is queried at most once)")
        if self.n_values < 1 or self.filler[0] >= VOCAB:
            what = "num_keys * num_values + num_keys + num_values" if self.fused else "num_keys + num_values"
            raise ConfigError(f"data.synthetic.{what} = {self.filler[0]} must leave filler ids below {VOCAB} "
                              "(and num_values >= 1)")

    def options(self):
        return {"num_pairs": self.n_pairs, "num_queries": self.n_queries, "num_keys": self.n_keys,
                "num_values": self.n_values, **({"fused_pairs": True} if self.fused else {})}

    @property
    def pair_len(self) -> int:
        return 1 if self.fused else 2

    def max_answers(self, row_len):
        return self.n_queries

    def distance_range(self, row_len):
        return 1, row_len

    def check(self, row_len: int) -> None:
        slots = (row_len + 1 - self.pair_len * self.n_pairs) // 2
        if slots < self.n_queries:
            raise ConfigError(f"mqar: rows of {row_len} tokens hold {max(slots, 0)} query slots after "
                              f"{self.n_pairs} key-value pairs; need {self.n_queries} (lower data.synthetic."
                              "num_pairs / num_queries or raise train.seq_len)")

    def make_row(self, rng, row_len, split, distance):
        self.check(row_len)
        n, L1, w = self.n_pairs, row_len + 1, self.pair_len
        keys = rng.choice(self.n_keys, size=n, replace=False)
        values = rng.integers(0, self.n_values, size=n)
        tokens = rng.integers(self.filler[0], self.filler[1], size=L1)
        if self.fused:  # pair i is one token, id keys[i] * num_values + values[i], at position i
            tokens[0:n] = keys * self.n_values + values
        else:  # pair i is the key at 2i, its value at 2i + 1
            tokens[0 : 2 * n : 2] = self.key0 + keys
            tokens[1 : 2 * n : 2] = self.value0 + values
        which = rng.choice(n, size=self.n_queries, replace=False)
        slots = np.sort(rng.choice((L1 - w * n) // 2, size=self.n_queries, replace=False))
        answers = []
        for i, slot in zip(which, slots):
            p = w * n + 2 * int(slot)  # the key; its value at p + 1 is target p
            tokens[p], tokens[p + 1] = self.key0 + keys[i], self.value0 + values[i]
            src = int(i) if self.fused else 2 * int(i) + 1  # where the value was given
            answers.append((p, 1, (p + 1) - src))
        return Row(tokens, answers)


class PasskeySource(SyntheticSource):
    name = "passkey"

    def __init__(self, data_cfg):
        super().__init__(data_cfg)
        self.plen = int(self.s.passkey_len)
        if not 1 <= self.plen <= 32:
            raise ConfigError(f"data.synthetic.passkey_len={self.plen} must be in [1, 32]")
        self._filler: dict[str, np.ndarray] = {}
        self._meta = None

    def options(self):
        return {"passkey_len": self.plen, "filler": "builtin", "needle": NEEDLE_PREFIX.decode()}

    def _filler_cfg(self):
        import ml_collections

        c = ml_collections.ConfigDict(self.data_cfg.to_dict())
        c.source, c.tokenizer = "builtin", "bytes"
        return c

    def metadata(self):
        if self._meta is None:
            meta = {"source": self.name, "generated": True, **self.options()}
            filler = builtin.BuiltinSource(self._filler_cfg()).metadata()
            meta["filler_content_hash"] = filler["content_hash"]
            meta["content_hash"] = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
            self._meta = meta
        return self._meta

    def filler(self, split: str) -> np.ndarray:
        """The built-in corpus split as one byte stream (its prepared token file, prepared once)."""
        if split not in self._filler:
            _, data, _ = prepare(self._filler_cfg(), [split], progress=False)
            self._filler[split] = data[split].tokens
        return self._filler[split]

    def max_answers(self, row_len):
        return 1

    def distance_range(self, row_len):
        q = len(NEEDLE_PREFIX) + self.plen  # the query closing the row
        a = row_len + 1 - self.plen  # first answer token
        lo = q + 1  # the needle (digits + newline) ends right before the query
        hi = a - len(NEEDLE_PREFIX)  # the needle starts at token 0
        if hi < lo:
            raise ConfigError(f"passkey: rows of {row_len} tokens cannot hold the needle and the query "
                              f"({2 * q + 1} tokens); raise the row length")
        return lo, hi

    def make_row(self, rng, row_len, split, distance):
        L1 = row_len + 1
        stream = self.filler(split)
        if len(stream) < L1:
            raise DataError(f"passkey: the built-in corpus split {split!r} has {len(stream):,} bytes, fewer than "
                            f"a row of {L1}; set data.path to a larger folder of .py files")
        start = int(rng.integers(0, len(stream) - L1 + 1))
        tokens = np.asarray(stream[start : start + L1], np.int64).copy()
        digits = np.frombuffer(b"0123456789", np.uint8)[rng.integers(0, 10, size=self.plen)].astype(np.int64)
        prefix = np.frombuffer(NEEDLE_PREFIX, np.uint8).astype(np.int64)
        a = L1 - self.plen
        tokens[a - len(prefix) : a] = prefix
        tokens[a:] = digits
        s = a - int(distance)  # first needle digit
        tokens[s - len(prefix) : s] = prefix
        tokens[s : s + self.plen] = digits
        tokens[s + self.plen] = ord("\n")
        return Row(tokens, [(a - 1, self.plen, int(distance))])


class CopySource(SyntheticSource):
    name = "copy"

    def __init__(self, data_cfg):
        super().__init__(data_cfg)
        self.n, self.vocab = int(self.s.copy_len), int(self.s.copy_vocab)
        if self.n < 1:
            raise ConfigError(f"data.synthetic.copy_len={self.n} must be >= 1")
        if not 2 <= self.vocab < COPY_MARKER - 1:
            raise ConfigError(f"data.synthetic.copy_vocab={self.vocab} must be in [2, {COPY_MARKER - 2}] "
                              f"(ids above it are filler, {COPY_MARKER} marks the copy)")

    def options(self):
        return {"copy_len": self.n, "copy_vocab": self.vocab, "marker": COPY_MARKER}

    def max_answers(self, row_len):
        return 1

    def distance_range(self, row_len):
        lo = self.n + 1  # the segment ends right before the marker
        hi = row_len + 1 - self.n  # the segment starts at token 0
        if hi < lo:
            raise ConfigError(f"copy: rows of {row_len} tokens cannot hold a segment of {self.n} twice; "
                              "lower data.synthetic.copy_len or raise the row length")
        return lo, hi

    def make_row(self, rng, row_len, split, distance):
        L1 = row_len + 1
        tokens = rng.integers(self.vocab, COPY_MARKER, size=L1)
        seg = rng.integers(0, self.vocab, size=self.n)
        a = L1 - self.n
        tokens[a - 1] = COPY_MARKER
        tokens[a:] = seg
        s = a - int(distance)
        tokens[s : s + self.n] = seg
        return Row(tokens, [(a - 1, self.n, int(distance))])


class RowBatcher:
    """The stateless batcher of a generated source: the batch of step s is rows 0..B-1 of step s,
    each a pure function of (seed, s, row); a host takes its slice of the global rows. A source with
    ``example_len`` (``data.packing='segments'``) packs several examples a row."""

    def __init__(self, source: SyntheticSource, *, row_len: int, batch_size: int, seed: int,
                 shard: tuple[int, int] = (0, 1)):
        self.source, self.row_len, self.batch_size, self.seed = source, row_len, batch_size, seed
        self.shard_index, self.num_shards = shard
        source.check_rows(row_len)  # fail early on settings that do not fit the rows

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """{'tokens': [B_local, row_len + 1] int32, 'weights': [B_local, row_len] float32}; packed, also
        'segment_ids' and 'positions' [B_local, row_len + 1] int32."""
        lo = self.shard_index * self.batch_size // self.num_shards
        hi = (self.shard_index + 1) * self.batch_size // self.num_shards
        make = self.source.packed_rows if self.source.example_len else self.source.rows
        b = make(seed=self.seed, step=step, rows=np.arange(lo, hi), row_len=self.row_len)
        return {k: b[k] for k in ("tokens", "weights", "segment_ids", "positions") if k in b}
