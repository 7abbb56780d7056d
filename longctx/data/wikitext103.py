"""WikiText-103 (Merity et al. 2016), word level.

``data.path`` is the folder unpacked from ``wikitext-103-v1.zip`` (``wiki.{train,valid,test}.tokens``)
or, with ``data.options.raw=True``, from ``wikitext-103-raw-v1.zip`` (``wiki.{train,valid,test}.raw``).
A parent folder holding ``wikitext-103/`` (or ``wikitext-103-raw/``) works too, and so do
Transformer-XL's renamed copies ``train.txt`` / ``valid.txt`` / ``test.txt``.

Tokens: every line (split at ``\\n`` only) gives its whitespace-separated words, then one
``<eos>``; empty lines give just ``<eos>``. ``<unk>`` and ``@-@``-style tokens are ordinary words.

Documents: articles. An article starts at the blank line before a top-level heading
``= Title =`` (not ``= = Section = =``). Concatenated, the documents are exactly the file's
token stream; the configs evaluate with ``eval.reset='never'`` (one stream, as Transformer-XL).

Word vocabulary (``data.tokenizer='words'``): ``<eos>`` (id 0), then every word type of the
train split by descending count, ties by first occurrence; saved as ``vocab.txt`` beside the
token files. Other tokenizers: ``sentencepiece`` (trained on train) or ``bytes``.

Real files are recognised by their line counts (1,801,350 / 3,760 / 4,358). With
``data.options.verify=True`` (default) the ``.tokens`` token counts are asserted against the
official 103,227,021 / 217,646 / 245,569 (during preparation, before a manifest is written)
and the vocabulary size against 267,735. ``metadata()['word_counts']`` holds the official
counts for real files (the word-level normaliser for non-word tokenizers; docs/datasets.md, WikiText-103) and
the counted tokens (words + one ``<eos>`` per line) for other files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from longctx.data import spm, tokenizers, wordvocab
from longctx.data.dsutil import data_path, drop_manifests, option
from longctx.errors import DataError

URLS = {
    False: "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
    True: "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip",
}
MD5_TOKENS_ZIP = "9ddaacaf6af0710eda8c456decff7832"
LINES = {"train": 1_801_350, "valid": 3_760, "test": 4_358}
TOKENS = {"train": 103_227_021, "valid": 217_646, "test": 245_569}
VOCAB_SIZE = 267_735
SPLITS = ("train", "valid", "test")


def where(raw: bool) -> str:
    name = "wikitext-103-raw-v1.zip" if raw else "wikitext-103-v1.zip"
    return (f"WikiText-103 comes as {name} (the Salesforce/MetaMind release, originally {URLS[raw]}"
            f"{', md5 ' + MD5_TOKENS_ZIP if not raw else ''}; mirrored on the Hugging Face Hub as 'Salesforce/wikitext'); unzip it and set data.path to the folder with wiki.{{train,valid,test}}."
            f"{'raw' if raw else 'tokens'}")


def is_title(line: str) -> bool:
    s = line.strip()
    return len(s) > 4 and s.startswith("= ") and s.endswith(" =") and not s.startswith("= =")


def find_files(path: str, raw: bool) -> dict[str, Path]:
    if not path:
        raise DataError(f"wikitext103: set data.path. {where(raw)}")
    root = Path(path).expanduser()
    ext = "raw" if raw else "tokens"
    candidates = [root, root / ("wikitext-103-raw" if raw else "wikitext-103")]
    for d in candidates:
        files = {s: d / f"wiki.{s}.{ext}" for s in SPLITS}
        if all(f.is_file() for f in files.values()):
            return _not_empty(files, raw)
    if not raw:
        files = {s: root / f"{s}.txt" for s in SPLITS}
        if all(f.is_file() for f in files.values()):
            return _not_empty(files, raw)
    missing = [str(root / f"wiki.{s}.{ext}") for s in SPLITS if not (root / f"wiki.{s}.{ext}").is_file()]
    raise DataError(f"wikitext103: missing {', '.join(missing)}. {where(raw)}")


def _not_empty(files: dict[str, Path], raw: bool) -> dict[str, Path]:
    empty = [str(f) for f in files.values() if f.stat().st_size == 0]
    if empty:
        raise DataError(f"wikitext103: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty (a failed copy "
                        f"or unzip?). {where(raw)}")
    return files


def iter_lines(path: Path):
    """Complete lines without their ``\\n`` (a last line lacking ``\\n`` counts as a line)."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                yield raw.rstrip(b"\n").decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"wikitext103: {path} line {i} is not UTF-8 text ({e.reason} at byte {e.start}); "
                                "expected the text files of the WikiText-103 release: unzip it again") from None


class WikiText103Source:
    name = "wikitext103"
    splits = SPLITS
    default_tokenizer = "words"

    def __init__(self, data_cfg=None, path: str | None = None, *, raw: bool | None = None, verify: bool | None = None):
        self.raw = bool(option(data_cfg, "raw", False) if raw is None else raw)
        self.verify = bool(option(data_cfg, "verify", True) if verify is None else verify)
        self.files = find_files(path if path is not None else data_path(data_cfg), self.raw)
        self.data_cfg = data_cfg
        self._meta: dict | None = None

    # -- content -----------------------------------------------------------------------------
    def lines(self, split: str):
        return iter_lines(self.files[split])

    def metadata(self) -> dict:
        if self._meta is not None:
            return self._meta
        h = hashlib.sha256(f"wikitext103|raw={self.raw}".encode())
        lines = {}
        for s in SPLITS:
            fh, n, last = hashlib.sha256(), 0, b"\n"
            with open(self.files[s], "rb") as f:
                while b := f.read(1 << 24):
                    fh.update(b)
                    n += b.count(b"\n")
                    last = b[-1:]
            h.update(s.encode() + fh.digest())
            lines[s] = n + (last != b"\n")
        real = all(lines[s] == LINES[s] for s in SPLITS)
        if real:
            word_counts = dict(TOKENS)
            kind = "official WikiText-103 token counts (words + one <eos> per line)"
        else:
            word_counts = {s: sum(len(ln.split()) + 1 for ln in self.lines(s)) for s in SPLITS}
            kind = "counted: whitespace words + one <eos> per line (not the real WikiText-103 files)"
        self._meta = {
            "source": self.name,
            "files": {s: str(f) for s, f in self.files.items()},
            "raw": self.raw,
            "real": real,
            "verified": self.verify and real,
            "line_counts": lines,
            "word_counts": word_counts,
            "word_counts_kind": kind,
            "documents": "articles (cut at the blank line before each '= Title =' heading)",
            "content_hash": h.hexdigest(),
        }
        return self._meta

    def articles(self, split: str):
        """(name, [lines]) per article."""
        buf: list[str] = []
        prev_blank = False
        n = 0
        for line in self.lines(split):
            if is_title(line) and buf:
                cut = len(buf) - 1 if prev_blank else len(buf)
                if cut > 0:
                    yield f"{split}/{n:06d}", buf[:cut]
                    n += 1
                    buf = buf[cut:]
            buf.append(line)
            prev_blank = not line.strip()
        if buf:
            yield f"{split}/{n:06d}", buf

    def documents(self, split: str):
        if split not in SPLITS:
            raise DataError(f"wikitext103: unknown split {split!r}; splits: {', '.join(SPLITS)}")
        check = self.verify and not self.raw and self.metadata()["real"]
        tokens = 0
        for name, lines in self.articles(split):
            if check:
                tokens += sum(len(ln.split()) + 1 for ln in lines)
            yield name, "".join(ln + "\n" for ln in lines)
        if check and tokens != TOKENS[split]:
            raise DataError(f"wikitext103: {self.files[split]} gives {tokens:,} tokens (words + <eos> per line), "
                            f"expected {TOKENS[split]:,}; the file is damaged. {where(self.raw)}")

    # -- tokenizer hooks ---------------------------------------------------------------------
    def tokenizer_kwargs(self, data_cfg, meta) -> dict:
        tok = getattr(data_cfg, "tokenizer", "words")
        if tok == "sentencepiece":
            return {"vocab_size": int(option(data_cfg, "vocab_size", 0) or spm.DEFAULT_VOCAB),
                    "max_chars": int(option(data_cfg, "spm_max_chars", 10**9))}
        return {}

    def build_tokenizer(self, data_cfg, directory: Path):
        directory = Path(directory)
        tok = getattr(data_cfg, "tokenizer", "words")
        if tok == "words":
            return self.word_tokenizer(directory)
        if tok == "sentencepiece":
            kw = self.tokenizer_kwargs(data_cfg, None)
            texts = lambda: ("".join(ln + "\n" for ln in lines) for _, lines in self.articles("train"))
            return spm.train_or_load(texts, directory, vocab_size=kw["vocab_size"], max_chars=kw["max_chars"])
        return tokenizers.build(tok)

    def word_tokenizer(self, directory: Path) -> wordvocab.WordTokenizer:
        path = Path(directory) / wordvocab.VOCAB_FILE
        if not path.is_file():
            drop_manifests(Path(directory))
            words = wordvocab.build_vocab(self.lines("train"))
            if self.verify and not self.raw and self.metadata()["real"] and len(words) != VOCAB_SIZE:
                raise DataError(f"wikitext103: the train split has {len(words) - 1:,} word types, so the vocabulary has "
                                f"{len(words):,} entries, expected {VOCAB_SIZE:,}; {self.files['train']} is damaged. "
                                f"{where(self.raw)}")
            wordvocab.save_vocab(words, path)
        return wordvocab.WordTokenizer(path)
