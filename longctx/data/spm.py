"""SentencePiece tokenizer trained on a source's train split (PG-19 convention).

Training settings (Transformer-VQ's PG-19 vocabulary; docs/datasets.md, PG-19): BPE,
``data.options.vocab_size`` pieces (0, the default: 32,000), ``character_coverage=1.0``,
pad 0 / eos 1 / unk 2, no BOS, on the first ``data.options.spm_max_chars``
characters (default 10^9) of the train split, read book by book in the source's
order and fed line by line (empty lines skipped). Other trainer settings are
SentencePiece's defaults (NFKC normalization, extra whitespace removed, so line
breaks are not kept in the token stream). The model is saved as ``spm.model``
beside the prepared token files and reused.

``encode(text)`` never adds EOS, except for a :class:`TextWithEos` payload
(what document-based sources yield), which gets one EOS (id 1) appended: one EOS
per document in the token files, none after a sampling prompt.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from longctx.data.dsutil import atomic_write, drop_manifests
from longctx.errors import ConfigError, DataError

MODEL_FILE = "spm.model"
DEFAULT_VOCAB = 32000  # pieces where data.options.vocab_size is 0
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


class TextWithEos(str):
    """A document's text; tokenizers with an EOS id append it after the document."""

    __slots__ = ()


class SentencePieceTokenizer:
    name = "sentencepiece"
    one_token_per_byte = False

    def __init__(self, model_path: str | Path | None = None, **_ignored):
        import sentencepiece as spm

        if not model_path:
            raise ConfigError(
                "data.tokenizer='sentencepiece' is trained on the train split by the data source "
                "(data.source='pg19' or 'wikitext103'); run longctx-prepare with that source"
            )
        if not Path(model_path).is_file():
            raise DataError(f"SentencePiece model {model_path} is missing; run longctx-prepare")
        self.model_path = Path(model_path)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))
        self.vocab_size = int(self.sp.get_piece_size())
        self.eos_id = int(self.sp.eos_id())
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def encode(self, data: bytes | str) -> np.ndarray:
        text = data.decode("utf-8") if isinstance(data, bytes) else str(data)
        ids = self.sp.encode(text, out_type=int)
        if isinstance(data, TextWithEos) and self.eos_id >= 0:
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode("utf-8")


def training_lines(texts, max_chars: int):
    """Non-empty lines of ``texts`` until ``max_chars`` characters (line breaks included) are used."""
    used = 0
    for text in texts:
        for line in str(text).split("\n"):
            if used >= max_chars:
                return
            line = line[: max_chars - used]
            used += len(line) + 1
            if line.strip():
                yield line


def train_model(texts, *, vocab_size: int, max_chars: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_lines(texts, max_chars),
            model_writer=buf,
            model_type="bpe",
            vocab_size=int(vocab_size),
            character_coverage=1.0,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(f"SentencePiece training failed ({str(e).strip().splitlines()[-1]}); "
                        f"lower data.options.vocab_size={vocab_size} for a small corpus") from None
    return buf.getvalue()


def train_or_load(texts_fn, directory: Path, *, vocab_size: int, max_chars: int) -> SentencePieceTokenizer:
    """The tokenizer saved in ``directory``, trained first (from ``texts_fn()``) if absent.

    When it has to be trained, manifests already in ``directory`` are removed first,
    so token files made with another model are never reused."""
    path = Path(directory) / MODEL_FILE
    if not path.is_file():
        drop_manifests(Path(directory))
        atomic_write(path, train_model(texts_fn(), vocab_size=vocab_size, max_chars=max_chars))
    tok = SentencePieceTokenizer(path)
    if tok.vocab_size != vocab_size:
        raise DataError(f"{path} has {tok.vocab_size} pieces, expected {vocab_size}; delete it and prepare again")
    return tok
