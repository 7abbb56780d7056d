"""Word-level tokenizer (WikiText-103 convention).

Text is cut into lines at ``\\n``; each line gives its whitespace-separated words
(Python ``str.split()``) followed by one ``<eos>``; an empty line gives just ``<eos>``.
Text after the last ``\\n`` gives its words without ``<eos>`` (a prompt that does not
end a line). ``<eos>`` is id 0.

The vocabulary file ``vocab.txt`` has one word per line, in id order. It is built by
:func:`build_vocab` from a word stream: ``<eos>`` first, then every word type by
descending count, ties broken by first occurrence in the stream. Words outside the
vocabulary map to ``<unk>`` when the vocabulary has it (WikiText's ``.tokens`` files
do), else encoding raises :class:`DataError`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from longctx.data.dsutil import atomic_write
from longctx.errors import ConfigError, DataError

EOS = "<eos>"
UNK = "<unk>"
VOCAB_FILE = "vocab.txt"


def line_tokens(line: str) -> list[str]:
    """The tokens of one complete line: its words, then <eos>."""
    return line.split() + [EOS]


def build_vocab(lines) -> list[str]:
    """``<eos>`` + word types of ``lines`` (complete lines, without their ``\\n``) by count
    descending, then first occurrence."""
    counts: Counter = Counter()
    for line in lines:
        counts.update(line.split())
    # Counter keeps insertion (= first occurrence) order; sorted() is stable.
    words = sorted((w for w in counts if w != EOS), key=lambda w: -counts[w])
    return [EOS] + words


def save_vocab(words: list[str], path: Path) -> None:
    atomic_write(Path(path), ("\n".join(words) + "\n").encode("utf-8"))


def load_vocab(path: Path) -> list[str]:
    text = Path(path).read_bytes().decode("utf-8")
    if not text.endswith("\n"):
        raise DataError(f"{path}: truncated vocabulary file; delete it and prepare again")
    return text[:-1].split("\n")


class WordTokenizer:
    name = "words"
    dtype = np.uint32
    one_token_per_byte = False

    def __init__(self, vocab_path: str | Path | None = None, words: list[str] | None = None):
        if words is None:
            if not vocab_path:
                raise ConfigError(
                    "data.tokenizer='words' needs a vocabulary: it is built from the train split by "
                    "data.source='wikitext103' (use that source, or pass vocab_path)"
                )
            if not Path(vocab_path).is_file():
                raise DataError(f"word vocabulary {vocab_path} is missing; run longctx-prepare")
            words = load_vocab(Path(vocab_path))
        if not words or words[0] != EOS:
            raise DataError(f"word vocabulary must start with {EOS!r} (id 0), got {words[:1]!r}")
        if len(set(words)) != len(words):
            raise DataError("word vocabulary has duplicate entries; delete it and prepare again")
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words)
        self.eos_id = 0
        self.unk_id = self.index.get(UNK)

    def _id(self, w: str) -> int:
        i = self.index.get(w)
        if i is not None:
            return i
        if self.unk_id is None:
            raise DataError(f"word {w!r} is not in the vocabulary and the vocabulary has no {UNK!r}")
        return self.unk_id

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, bytes):
            data = data.decode("utf-8")
        lines = data.split("\n")
        toks: list[str] = []
        for line in lines[:-1]:
            toks.extend(line.split())
            toks.append(EOS)
        toks.extend(lines[-1].split())
        idx = self.index
        try:
            ids = [idx[w] for w in toks]
        except KeyError:
            ids = [self._id(w) for w in toks]
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids) -> str:
        out, line = [], []
        for i in np.asarray(ids).reshape(-1).tolist():
            if i == self.eos_id:
                out.append(" ".join(line) + "\n")
                line = []
            else:
                line.append(self.words[i] if 0 <= i < self.vocab_size else UNK)
        return "".join(out) + " ".join(line)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode("utf-8")
