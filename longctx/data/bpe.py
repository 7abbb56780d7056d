"""A lossless byte-level BPE tokenizer trained on a source's train split (``data.tokenizer='bpe'``).

Bytes, not text: a document's bytes are mapped one to one onto the characters U+0000..U+00FF (Latin-1
decoding, so every byte string is valid input, UTF-8 or not) and cut by a BPE model of the ``tokenizers``
package whose alphabet is those 256 characters. A token is therefore a byte string, its length in bytes is
its length in characters, and ``decode_bytes(encode(b)) == b`` for every byte string ``b``. Text (``str``)
is encoded as its UTF-8 bytes.

Training (``tokenizers.trainers.BpeTrainer``): ``data.options.vocab_size`` ids in all (0, the base config's
value: 4,096, the size measured for the built-in corpus in docs/datasets.md) for the 256 bytes, the merges, and one end-of-document id (the last id, no bytes) appended after each
:class:`~longctx.data.spm.TextWithEos` payload (the documents of sources that mark them, as for
``sentencepiece``; the built-in corpus yields raw bytes and gets none, as with ``bytes``). The end-of-document id is not a token of the BPE
model, so no text ever encodes to it. No normaliser (nothing folded, whitespace and indentation kept); the
pre-tokeniser splits the Latin-1 text with :data:`PATTERN` (GPT-2's rule: letters, digits, other symbols,
each with one leading space, and runs of whitespace) and keeps every character (``behavior='isolated'``),
so merges never cross those pieces (the classes are Latin-1's: the bytes of a UTF-8 character beyond ASCII
are letters or symbols as their Latin-1 characters are). Pairs seen fewer than :data:`MIN_FREQUENCY` times are not merged. When
the corpus runs out of pairs first, the ids between the last merge and the end-of-document id are never
produced (byte length 0).

The model is trained on the train split only, read in the source's order, and saved as
``<cache_dir>/<source>-bpe-vocab-<hash12>/bpe.json`` (hash of the corpus content and the settings), then
reused; its sha256 is part of the token files' cache key, so token files made with another vocabulary are
never reused.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from longctx.data import sources
from longctx.data.dsutil import option
from longctx.data.files import need
from longctx.data.prepare import atomic_write_with, default_cache_dir, sha256_file
from longctx.data.spm import TextWithEos
from longctx.errors import ConfigError, DataError

DEFAULT_VOCAB = 4096
MIN_FREQUENCY = 2
MODEL_FILE = "bpe.json"
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def as_chars(data: bytes | str) -> str:
    """One character (U+0000..U+00FF) per byte of ``data`` (text: its UTF-8 bytes)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return bytes(data).decode("latin-1")


def settings(data_cfg) -> dict:
    vocab = int(option(data_cfg, "vocab_size", 0))
    vocab = DEFAULT_VOCAB if vocab <= 0 else vocab
    if vocab < 258:
        raise ConfigError(f"data.options.vocab_size={vocab}: a byte-level BPE needs at least 258 ids (the 256 bytes, "
                          "one merge and the end-of-document id)")
    return {"vocab_size": vocab, "min_frequency": MIN_FREQUENCY, "pattern": PATTERN}


def _tokenizers():
    return need("tokenizers", "hf")


def train_model(payloads, *, vocab_size: int, min_frequency: int = MIN_FREQUENCY, pattern: str = PATTERN) -> str:
    """The JSON of a BPE model with ``vocab_size - 1`` tokens (the end-of-document id comes on top) trained on
    ``payloads`` (bytes or text)."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated")
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=min_frequency, show_progress=False,
                                     initial_alphabet=[chr(i) for i in range(256)], special_tokens=[])
    tok.train_from_iterator((as_chars(p) for p in payloads), trainer=trainer)
    return tok.to_str()


def model_path(data_cfg, source=None, meta=None) -> Path:
    """Where the model trained for ``data_cfg`` is cached (it may not exist yet)."""
    kw = settings(data_cfg)
    meta = meta if meta is not None else (source or sources.build(data_cfg)).metadata()
    key = hashlib.sha256((meta["content_hash"] + json.dumps(kw, sort_keys=True)).encode()).hexdigest()[:12]
    root = Path(data_cfg.cache_dir) if getattr(data_cfg, "cache_dir", "") else default_cache_dir()
    return root / f"{meta['source']}-bpe-vocab-{key}" / MODEL_FILE


def tokenizer_kwargs(data_cfg) -> dict:
    """The trained model's file and sha256 (trained on the train split first if absent): what the token cache is
    keyed by."""
    kw = settings(data_cfg)
    source = sources.build(data_cfg)
    meta = source.metadata()
    path = model_path(data_cfg, meta=meta)
    if not path.is_file():
        if "train" not in source.splits:
            raise DataError(f"data.tokenizer='bpe' is trained on the train split; data.source={meta['source']!r} has "
                            f"none (splits: {', '.join(source.splits)})")
        t0 = time.perf_counter()
        print(f"learning a byte-level BPE of {kw['vocab_size']:,} tokens on the train split of "
              f"data.source={meta['source']!r} (once: cached in {path.parent})...", file=sys.stderr, flush=True)
        text = train_model((p for _, p in source.documents("train")), **kw)
        print(f"learned the BPE in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_with(path, lambda f: f.write(text.encode("utf-8")))
    return {"vocab_size": kw["vocab_size"], "tokenizer_file": str(path), "file_sha256": sha256_file(path)}


class BPETokenizer:
    """Byte-level BPE (see the module doc): ids ``[0, vocab_size - 1)`` are byte strings, ``eos_id`` is the last."""

    name = "bpe"
    one_token_per_byte = False
    cache_kwargs = staticmethod(tokenizer_kwargs)  # what longctx.data.prepare keys the token cache by

    @staticmethod
    def is_trained(data_cfg, meta) -> bool:
        """Whether the model ``data_cfg`` asks for is trained already (``cache_kwargs`` would train it)."""
        return model_path(data_cfg, meta=meta).is_file()

    def __init__(self, tokenizer_file: str = "", vocab_size: int = DEFAULT_VOCAB, **_ignored):
        if not tokenizer_file:
            raise ConfigError("data.tokenizer='bpe' is trained on the train split when the data is prepared; this "
                              "data source does not pass the trained model on (served: sources without their own "
                              "tokenizer hook, such as builtin and enwik8)")
        tk = _tokenizers()
        self.tokenizer_file = Path(tokenizer_file)
        if not self.tokenizer_file.is_file():
            raise DataError(f"BPE model {tokenizer_file} is missing; run longctx-prepare")
        # named `model`, not `tok`: helpers for Hugging Face tokenizer.json files look for `tok`
        self.model = tk.Tokenizer.from_file(str(self.tokenizer_file))
        vocab = self.model.get_vocab(with_added_tokens=False)
        self.vocab_size = int(vocab_size)
        if max(vocab.values()) >= self.vocab_size - 1:
            raise DataError(f"{tokenizer_file} has {len(vocab)} tokens, more than data.options.vocab_size="
                            f"{self.vocab_size} allows; delete it and prepare again")
        self.eos_id = self.vocab_size - 1
        self.pieces = [b""] * self.vocab_size
        for s, i in vocab.items():
            self.pieces[i] = s.encode("latin-1")
        self._lengths = np.array([len(p) for p in self.pieces], np.int64)
        self._lengths.setflags(write=False)
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def encode(self, data: bytes | str) -> np.ndarray:
        ids = self.model.encode(as_chars(data), add_special_tokens=False).ids
        if isinstance(data, TextWithEos):
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=self.dtype)

    def decode_bytes(self, ids) -> bytes:
        pieces = self.pieces
        return b"".join(pieces[int(i)] for i in np.asarray(ids).reshape(-1))

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def byte_lengths(self) -> np.ndarray:
        """[vocab_size] int64: the bytes each id stands for (0 for the end-of-document id)."""
        return self._lengths
