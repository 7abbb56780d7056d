"""PG-19 (Rae et al. 2020): 28,752 Project Gutenberg books published before 1919.

``data.path`` is a local copy of the bucket ``gs://deepmind-gutenberg`` layout::
    metadata.csv              no header; book_id,short_book_title,publication_date,url
    train/<book_id>.txt       28,602 books
    validation/<book_id>.txt  50 books   (split 'valid' here)
    test/<book_id>.txt        100 books

The folder defines the split. Books are documents, read in ascending integer
``book_id`` order, decoded as UTF-8 and ``.strip()``-ed (as the tfds builder does).
Each book is yielded as a :class:`~longctx.data.spm.TextWithEos`, so the
``sentencepiece`` tokenizer appends one EOS (id 1) per book; the EOS tokens are
part of the scored stream (Transformer-VQ's convention). With ``bytes`` there is
no EOS token; book boundaries are still in the document offsets.

Word-level perplexity (the official metric) = exp(total NLL of the split / n_words)
with the constants of Rae et al. 2020 Table 2: ``metadata()['word_counts']`` holds
3,007,061 (valid) and 6,966,499 (test) (and 1,973,136,207 for train) when the split
folder holds the official number of books; otherwise (a partial copy or a test
fixture) the whitespace word count of the split, labelled as a diagnostic.

``data.options.tfds=True`` reads the books through tensorflow_datasets' ``pg19``
builder instead (``pip install -e ".[tfds]"`` from the checkout, plus TensorFlow), with the builder's
``_DATA_DIR`` pointed at ``data.path`` so nothing is fetched from GCS; tfds writes its
prepared copy under ``<cache_dir>/tfds``. Books then come in tfds's own (deterministic)
order, so the token files differ from the folder reader's by book order only.
"""

from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path

from longctx.data import spm, tokenizers
from longctx.data.dsutil import data_path, option
from longctx.data.prepare import default_cache_dir
from longctx.data.spm import TextWithEos
from longctx.errors import DataError

FOLDERS = {"train": "train", "valid": "validation", "test": "test"}
BOOKS = {"train": 28_602, "valid": 50, "test": 100}
WORDS = {"train": 1_973_136_207, "valid": 3_007_061, "test": 6_966_499}
METADATA_ROWS = 28_752
WHERE = ("PG-19 is published by DeepMind in the public bucket gs://deepmind-gutenberg (copy it with "
         "`gsutil -m cp -r gs://deepmind-gutenberg <dir>`; see github.com/google-deepmind/pg19; also mirrored on the "
         "Hugging Face Hub as 'deepmind/pg19'); set data.path to the folder holding metadata.csv, train/, validation/, test/")


def read_metadata(path: Path) -> dict[int, tuple[str, str, str]]:
    if not path.is_file():
        raise DataError(f"pg19: expected {path} (no header, 4 fields per row). {WHERE}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"pg19: {path} is not valid UTF-8 ({e.reason} at byte {e.start}); expected the bucket's "
                        f"UTF-8 metadata.csv (no header, 4 fields per row): copy it again. {WHERE}") from None
    out = {}
    for lineno, row in enumerate(csv.reader(io.StringIO(text)), 1):
        if not row:
            continue
        if len(row) != 4:
            raise DataError(f"pg19: {path} line {lineno} has {len(row)} fields, expected 4 "
                            f"(book_id,short_book_title,publication_date,url; no header)")
        try:
            book_id = int(row[0])
        except ValueError:
            raise DataError(f"pg19: {path} line {lineno}: book_id {row[0]!r} is not an integer (the file has no header)") from None
        out[book_id] = (row[1], row[2], row[3])
    return out


class PG19Source:
    name = "pg19"
    splits = ("train", "valid", "test")
    default_tokenizer = "sentencepiece"

    def __init__(self, data_cfg=None, path: str | None = None, *, use_tfds: bool | None = None):
        path = path if path is not None else data_path(data_cfg)
        if not path:
            raise DataError(f"pg19: set data.path. {WHERE}")
        self.root = Path(path).expanduser()
        if not self.root.is_dir():
            raise DataError(f"pg19: data.path={self.root} is not a folder. {WHERE}")
        self.use_tfds = bool(option(data_cfg, "tfds", False) if use_tfds is None else use_tfds)
        self.cache_dir = getattr(data_cfg, "cache_dir", "") if data_cfg is not None else ""
        self.meta_rows = read_metadata(self.root / "metadata.csv")
        self._meta: dict | None = None

    # -- listing -----------------------------------------------------------------------------
    def folder(self, split: str) -> Path:
        if split not in FOLDERS:
            raise DataError(f"pg19: unknown split {split!r}; splits: {', '.join(self.splits)}")
        return self.root / FOLDERS[split]

    def book_files(self, split: str) -> list[tuple[int, Path]]:
        d = self.folder(split)
        if not d.is_dir():
            raise DataError(f"pg19: expected the folder {d} of <book_id>.txt files for split {split!r}. {WHERE}")
        books = []
        for f in d.iterdir():
            if f.name.startswith("."):
                continue
            if f.suffix != ".txt" or not f.stem.isdigit():
                raise DataError(f"pg19: unexpected file {f}; a split folder holds only <book_id>.txt files")
            book_id = int(f.stem)
            if book_id not in self.meta_rows:
                raise DataError(f"pg19: {f} has no row in {self.root / 'metadata.csv'}; the copy is incomplete")
            books.append((book_id, f))
        books.sort()
        return books

    def read_book(self, path: Path) -> str:
        try:
            return path.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise DataError(f"pg19: {path} is not valid UTF-8 ({e}); copy it again. {WHERE}") from None

    # -- source interface --------------------------------------------------------------------
    def metadata(self) -> dict:
        if self._meta is not None:
            return self._meta
        h = hashlib.sha256(f"pg19|tfds={self.use_tfds}".encode())
        h.update(hashlib.sha256((self.root / "metadata.csv").read_bytes()).digest())
        counts, word_counts, kinds = {}, {}, {}
        for split in self.splits:
            if not self.folder(split).is_dir():
                continue
            books = self.book_files(split)
            if not books:
                raise DataError(f"pg19: {self.folder(split)} holds no <book_id>.txt books; the copy is incomplete. "
                                f"{WHERE}")
            counts[split] = len(books)
            official = len(books) == BOOKS[split]
            for book_id, f in books:
                # train: names and sizes (hashing 11 GB on every run is too slow); valid/test: full content
                h.update(f"{split}/{book_id}:{f.stat().st_size}".encode())
                if split != "train":
                    h.update(hashlib.sha256(f.read_bytes()).digest())
            if official:
                word_counts[split] = WORDS[split]
                kinds[split] = "official (Rae et al. 2020, Table 2)"
            elif split != "train":
                word_counts[split] = sum(len(self.read_book(f).split()) for _, f in books)
                kinds[split] = "whitespace count of this copy (diagnostic only: not the official PG-19 split)"
        self._meta = {
            "source": self.name,
            "root": str(self.root),
            "reader": "tfds pg19 builder" if self.use_tfds else "folder",
            "book_counts": counts,
            "metadata_rows": len(self.meta_rows),
            "word_counts": word_counts,
            "word_counts_kind": kinds,
            "documents": "one per book, books in ascending book_id order, text .strip()-ed, EOS appended by the tokenizer",
            "content_hash": h.hexdigest(),
        }
        return self._meta

    def documents(self, split: str):
        if self.use_tfds:
            yield from self._tfds_documents(split)
            return
        for book_id, f in self.book_files(split):
            yield str(book_id), TextWithEos(self.read_book(f))

    def _tfds_documents(self, split: str):
        self.folder(split)  # validates the split name
        try:
            import tensorflow_datasets as tfds
            from tensorflow_datasets.datasets.pg19 import pg19_dataset_builder
        except ImportError as e:
            raise DataError(f"pg19: data.options.tfds=True needs tensorflow-datasets and TensorFlow ({e}): "
                            f"pip install -e '.[tfds]' tensorflow from the longctx checkout, or set data.options.tfds=False to read the folder "
                            f"directly") from None

        # tfds 4.9.10 hard-codes gs://deepmind-gutenberg; the builder's own test patches this constant.
        pg19_dataset_builder._DATA_DIR = str(self.root)
        data_dir = Path(self.cache_dir or default_cache_dir()) / "tfds"
        builder = tfds.builder("pg19", data_dir=str(data_dir))
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        ds = builder.as_dataset(split={"train": "train", "valid": "validation", "test": "test"}[split], shuffle_files=False)
        for ex in tfds.as_numpy(ds):
            text = ex["book_text"]
            yield str(int(ex["book_id"])), TextWithEos(text.decode("utf-8") if isinstance(text, bytes) else text)

    # -- tokenizer hooks ---------------------------------------------------------------------
    def tokenizer_kwargs(self, data_cfg, meta) -> dict:
        if getattr(data_cfg, "tokenizer", "sentencepiece") == "sentencepiece":
            return {"vocab_size": int(option(data_cfg, "vocab_size", 0) or spm.DEFAULT_VOCAB),
                    "max_chars": int(option(data_cfg, "spm_max_chars", 10**9))}
        return {}

    def build_tokenizer(self, data_cfg, directory: Path):
        tok = getattr(data_cfg, "tokenizer", "sentencepiece")
        if tok == "sentencepiece":
            kw = self.tokenizer_kwargs(data_cfg, None)
            texts = lambda: (text for _, text in self.documents("train"))
            return spm.train_or_load(texts, Path(directory), vocab_size=kw["vocab_size"], max_chars=kw["max_chars"])
        if tok == "words":
            raise DataError("pg19 is open-vocabulary: use data.tokenizer='sentencepiece' or 'bytes', not 'words'")
        return tokenizers.build(tok)
