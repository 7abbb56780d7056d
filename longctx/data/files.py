"""Your own corpus from files: plain text, JSONL and Parquet (``data.source='files'``).

``data.path`` is a file, a folder (read recursively, in sorted order of the relative POSIX
paths; names starting with ``.`` are skipped) or a glob pattern. Each file's format comes from
its name (``data.options.format='auto'``): ``.jsonl`` / ``.json`` / ``.ndjson`` are JSON lines,
``.parquet`` is Parquet, anything else is UTF-8 text; a ``.gz`` suffix is decompressed on the fly.
``data.options.format`` = ``'text'`` | ``'jsonl'`` | ``'parquet'`` forces one format.

Documents:

- text, ``data.options.separator=''``: one document per file, as it is;
- text, a separator (e.g. ``'<|endoftext|>'``; ``\\n`` and ``\\t`` in it are line break and tab):
  the text between separators, stripped of surrounding whitespace;
- JSONL: one document per line, the string in the field ``data.options.text_field``;
- Parquet: one document per row, the string column ``data.options.text_field``.

Empty (or whitespace-only) documents and null values are skipped.

Splits: a folder holding entries named ``train``, ``valid`` (or ``validation``) and optionally
``test`` (files with any extension, or folders) gives the splits; so do
``data.options.train_path`` / ``valid_path`` / ``test_path``. Otherwise the documents of
``data.path`` are divided by ``data.options.split`` (train, valid, test fractions) with a
seeded permutation (``data.options.split_seed``): exact counts (valid and test get at least one
document each when their fraction is positive), each split in corpus order.

Reading is streamed: files are read in 1 MiB blocks, and a document larger than
:data:`PIECE` characters is handed to the tokenizer in pieces cut at line ends
(:class:`~longctx.data.prepare.Continued`), so preparing needs memory for one piece, not the
corpus. The cache key is a fingerprint of the file list (relative path, size, modification
time) and the options; a changed file is prepared again.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from longctx.data import spm, tokenizers
from longctx.data.dsutil import data_path, option
from longctx.data.prepare import Continued
from longctx.data.spm import TextWithEos
from longctx.errors import ConfigError, DataError

PIECE = 1 << 22  # characters: a longer document is tokenized in pieces cut at line ends
BLOCK = 1 << 20  # bytes read at a time
SPLITS = ("train", "valid", "test")
SPLIT_NAMES = {"train": ("train",), "valid": ("valid", "validation"), "test": ("test",)}
FORMATS = ("auto", "text", "jsonl", "parquet")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def need(module: str, extra: str):
    """Import an optional dependency, or say in one line how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"this needs the optional package {module.split('.')[0]!r}: "
                        f"pip install -e \".[{extra}]\" from the checkout") from None


def unescape(sep: str) -> str:
    return sep.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")


def _skip(name: str) -> bool:
    return name.startswith(".") or name == "__pycache__"


def list_files(path: str, what: str = "data.path") -> tuple[Path, list[Path]]:
    """(root, files) for a file, a folder (recursive, sorted) or a glob pattern."""
    if not path:
        raise DataError(f"files: set {what} to a text, JSONL or Parquet file, a folder of them or a glob pattern")
    p = Path(path).expanduser()
    if any(ch in path for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"files: {what}={path!r} matches no file")
        return Path(os.path.commonpath([str(f.parent) for f in files])), files
    if p.is_file():
        return p.parent, [p]
    if not p.exists():
        raise DataError(f"files: {what}={path!r} does not exist; set it to a file, a folder or a glob pattern")
    files = []
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = sorted(d for d in dirnames if not _skip(d))
        files.extend(Path(dirpath, f) for f in filenames if not _skip(f))
    files.sort(key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise DataError(f"files: {what}={path!r} is an empty folder: the corpus is empty")
    return p, files


def file_format(f: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = f.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def open_binary(f: Path):
    return gzip.open(f, "rb") if f.name.lower().endswith(".gz") else open(f, "rb")


def read_text(f: Path):
    """Decoded UTF-8 blocks of ``f``; a byte that is not UTF-8 is one line naming the file and offset."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open_binary(f) as fh:
        while True:
            b = fh.read(BLOCK)
            try:
                s = dec.decode(b, final=not b)
            except UnicodeDecodeError as e:
                raise DataError(f"files: {f} is not UTF-8 text ({e.reason} near byte {offset + max(e.start, 0):,}); "
                                "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            offset += len(b)
            if s:
                yield s
            if not b:
                return


def _cut(text: str) -> int:
    """Where to end a piece of ``text``: after its last line break, else at its end."""
    i = text.rfind("\n")
    return i + 1 if i >= 0 else len(text)


def text_file_docs(f: Path):
    """(index, text, last) of the one document of ``f`` (in pieces when it is long)."""
    buf, size, pieces = [], 0, 0
    for s in read_text(f):
        buf.append(s)
        size += len(s)
        if size >= PIECE:
            text = "".join(buf)
            cut = _cut(text)
            yield 0, text[:cut], False
            pieces += 1
            buf, size = [text[cut:]], len(text) - cut
    text = "".join(buf)
    if pieces or text.strip():
        yield 0, text, True


def separated_docs(f: Path, sep: str):
    """(index, text, last) of the documents of ``f`` between separators ``sep``, stripped."""
    buf, k, open_doc = "", 0, False  # open_doc: pieces of the current document were already given
    for s in read_text(f):
        buf += s
        pos = 0
        while (i := buf.find(sep, pos)) >= 0:
            text = buf[pos:i]
            if open_doc:
                yield k, text.rstrip(), True
                k, open_doc = k + 1, False
            elif text.strip():
                yield k, text.strip(), True
                k += 1
            pos = i + len(sep)
        buf = buf[pos:]
        if len(buf) >= PIECE:  # a long document: give a piece, keep what may start a separator
            cut = _cut(buf[: len(buf) - len(sep)])
            piece = buf[:cut]
            if open_doc or piece.strip():
                yield k, piece if open_doc else piece.lstrip(), False
                open_doc = True
            buf = buf[cut:]
    if open_doc:
        yield k, buf.rstrip(), True
    elif buf.strip():
        yield k, buf.strip(), True


def jsonl_docs(f: Path, field: str):
    with open_binary(f) as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"files: {f} line {lineno} is not UTF-8 text ({e.reason} at byte {e.start}); "
                                "convert the file to UTF-8") from None
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"files: {f} line {lineno} is not JSON ({e.msg}, column {e.colno}); "
                                "a JSONL file holds one JSON object per line") from None
            if not isinstance(obj, dict):
                raise DataError(f"files: {f} line {lineno} is a JSON {type(obj).__name__}, not an object with a "
                                f"{field!r} field")
            yield from _field_doc(f, f"line {lineno}", obj, field, lineno)


def _field_doc(f, where: str, obj: dict, field: str, index):
    if field not in obj:
        fields = ", ".join(sorted(map(str, obj))[:8]) or "none"
        raise DataError(f"files: {f} {where} has no field {field!r} (its fields: {fields}); set "
                        "data.options.text_field to the field that holds the text")
    text = obj[field]
    if text is None:
        return
    if not isinstance(text, str):
        raise DataError(f"files: {f} {where}: field {field!r} is a {type(text).__name__}, not text; set "
                        "data.options.text_field to the field that holds the text")
    if text.strip():
        yield index, text, True


def parquet_docs(f: Path, field: str):
    pq = need("pyarrow.parquet", "parquet")
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for a bad file
        raise DataError(f"files: {f} is not a Parquet file ({str(e).splitlines()[0][:160]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise DataError(f"files: {f} has no column {field!r} (its columns: {', '.join(names[:8])}); set "
                        "data.options.text_field to the column that holds the text")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise DataError(f"files: {f} column {field!r} holds {type(text).__name__} values, not text; set "
                                "data.options.text_field to the column that holds the text")
            if text is not None and text.strip():
                yield row, text, True
            row += 1


class FilesSource:
    """Text, JSONL and Parquet files (module docstring)."""

    name = "files"
    default_tokenizer = "bytes"

    def __init__(self, data_cfg=None, path: str | None = None):
        self.data_cfg = data_cfg
        self.path = path if path is not None else data_path(data_cfg)
        self.format = str(option(data_cfg, "format", "auto"))
        if self.format not in FORMATS:
            raise ConfigError(f"data.options.format={self.format!r}; allowed: {', '.join(FORMATS)}")
        self.text_field = str(option(data_cfg, "text_field", "text"))
        self.separator = unescape(str(option(data_cfg, "separator", "")))
        self.fractions = tuple(float(x) for x in option(data_cfg, "split", (0.9, 0.05, 0.05)))
        self.seed = int(option(data_cfg, "split_seed", 0))
        self.groups = self._groups()  # split (or 'all') -> (root, files)
        self.splits = tuple(s for s in SPLITS if s in self.groups) if "all" not in self.groups else tuple(
            s for s, frac in zip(SPLITS, self.fractions) if frac > 0)
        self._assign: np.ndarray | None = None
        self._counts: dict[str, int] = {}

    # -- files and splits -------------------------------------------------------------------
    def _groups(self) -> dict:
        explicit = {s: str(option(self.data_cfg, f"{s}_path", "")) for s in SPLITS}
        if any(explicit.values()):
            if not explicit["train"]:
                raise DataError("files: data.options.valid_path / test_path are set but train_path is not; set "
                                "data.options.train_path too (or none of them, to split data.path by fractions)")
            return {s: list_files(p, f"data.options.{s}_path") for s, p in explicit.items() if p}
        root = Path(self.path).expanduser() if self.path else None
        if root is not None and root.is_dir():
            found = {}
            for entry in sorted(root.iterdir()):
                stem = entry.name.split(".")[0].lower()
                for s, names in SPLIT_NAMES.items():
                    if stem in names and s not in found and not _skip(entry.name):
                        found[s] = entry
            if "train" in found and "valid" in found:
                return {s: list_files(str(e), f"the {s} split {e}") for s, e in found.items()}
        if len(self.fractions) != 3 or min(self.fractions) < 0 or not 0 < sum(self.fractions) <= 1.0 + 1e-9 \
                or self.fractions[0] <= 0:
            raise ConfigError(f"data.options.split={self.fractions} must be three fractions (train, valid, test) "
                              ">= 0 with train > 0 and a sum of at most 1")
        return {"all": list_files(self.path)}

    def metadata(self) -> dict:
        h = hashlib.sha256(f"files|{self.format}|{self.text_field}|{self.separator}|{self.fractions}|"
                           f"{self.seed}|{self.reader_key()}".encode())
        counts = {}
        for group, (root, files) in self.groups.items():
            h.update(f"\0{group}\0{root.resolve()}".encode())
            size = 0
            for f in files:
                st = f.stat()
                size += st.st_size
                h.update(f"{f.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            counts[group] = {"files": len(files), "bytes": size}
        return {
            "source": self.name,
            "path": str(self.path),
            "groups": counts,
            "splits": "files" if "all" not in self.groups else {"fractions": list(self.fractions), "seed": self.seed},
            "documents": self.documents_rule(),
            "content_hash": h.hexdigest(),
        }

    def reader_key(self) -> str:
        return "files"

    def documents_rule(self) -> str:
        if self.separator:
            return f"text between separators {self.separator!r}; JSONL lines / Parquet rows, field {self.text_field!r}"
        return f"one per text file; JSONL lines / Parquet rows, field {self.text_field!r}"

    # -- reading ----------------------------------------------------------------------------
    def raw_docs(self, root: Path, files: list[Path]):
        """(name, text, last) for every document of ``files``, in order."""
        for f in files:
            rel = f.relative_to(root).as_posix()
            fmt = file_format(f, self.format)
            if fmt == "jsonl":
                it = jsonl_docs(f, self.text_field)
            elif fmt == "parquet":
                it = parquet_docs(f, self.text_field)
            elif self.separator:
                it = separated_docs(f, self.separator)
            else:
                it = text_file_docs(f)
            for k, text, last in it:
                yield f"{rel}#{k}", text, last

    def _assignment(self) -> np.ndarray:
        """Split index (0 train, 1 valid, 2 test) of every document of the corpus, by fraction."""
        if self._assign is None:
            root, files = self.groups["all"]
            from tqdm.auto import tqdm

            # a first pass counts the documents (a bar on a terminal only: this pass has no --noprogress)
            with tqdm(desc="count documents", unit="doc", leave=False, disable=None) as bar:
                n = 0
                for _, _, last in self.raw_docs(root, files):
                    if last:
                        n += 1
                        bar.update(1)
            if n == 0:
                raise DataError(f"files: no documents in {self.path} ({len(files)} file(s), all empty or without "
                                "text): the corpus is empty")
            counts = [0, 0, 0]
            for i in (1, 2):
                counts[i] = int(round(n * self.fractions[i]))
                if self.fractions[i] > 0 and counts[i] == 0:
                    counts[i] = 1
            counts[0] = n - counts[1] - counts[2] if sum(self.fractions) >= 1 - 1e-9 else int(round(n * self.fractions[0]))
            if counts[0] <= 0:
                raise DataError(f"files: {self.path} has {n} document(s), too few for a train split beside valid and "
                                "test; add documents or give the splits as files (data.options.train_path, ...)")
            order = np.random.default_rng(self.seed).permutation(n)
            assign = np.full(n, 3, np.uint8)  # 3: not used (fractions summing to less than 1)
            assign[order[: counts[1]]] = 1
            assign[order[counts[1]: counts[1] + counts[2]]] = 2
            assign[order[counts[1] + counts[2]: counts[1] + counts[2] + counts[0]]] = 0
            self._assign = assign
            self._counts = {s: counts[i] for i, s in enumerate(SPLITS)}
        return self._assign

    def count(self, split: str) -> int | None:
        """Documents in ``split`` when known before reading it (a progress bar's total)."""
        if "all" in self.groups:
            self._assignment()
            return self._counts.get(split)
        return None

    def documents(self, split: str):
        if split not in self.splits:
            raise DataError(f"files: the corpus has no {split!r} split (splits: {', '.join(self.splits)}); give it "
                            f"with data.options.{split}_path or a nonzero fraction in data.options.split")
        if "all" in self.groups:
            want = SPLITS.index(split)
            assign = self._assignment()
            docs = self._indexed(assign, want)
            root, files = self.groups["all"]
        else:
            root, files = self.groups[split]
            docs = self.raw_docs(root, files)
        n = 0
        for name, text, last in docs:
            n += last
            yield name, (TextWithEos(text) if last else Continued(text))
        if n == 0:
            raise DataError(f"files: the {split} split ({root}, {len(files)} file(s)) holds no documents: all empty "
                            "or without text; the corpus is empty")

    def _indexed(self, assign, want: int):
        root, files = self.groups["all"]
        i = 0
        for name, text, last in self.raw_docs(root, files):
            if assign[i] == want:
                yield name, text, last
            i += last

    # -- tokenizer hooks ---------------------------------------------------------------------
    def tokenizer_kwargs(self, data_cfg, meta) -> dict:
        if getattr(data_cfg, "tokenizer", "bytes") == "sentencepiece":
            return {"vocab_size": int(option(data_cfg, "vocab_size", 0) or spm.DEFAULT_VOCAB),
                    "max_chars": int(option(data_cfg, "spm_max_chars", 10**9))}
        return {}

    def build_tokenizer(self, data_cfg, directory: Path):
        tok = getattr(data_cfg, "tokenizer", "bytes")
        if tok == "words":
            raise ConfigError(f"data.tokenizer='words' is WikiText-103's word vocabulary; with data.source="
                              f"{self.name!r} use bytes, sentencepiece (trained on the train split) or hf (a tokenizer.json)")
        if tok == "sentencepiece":
            kw = self.tokenizer_kwargs(data_cfg, None)

            def texts():
                doc = []
                for _, payload in self.documents("train"):
                    doc.append(str(payload))
                    if not isinstance(payload, Continued):
                        yield "".join(doc)
                        doc = []

            return spm.train_or_load(texts, Path(directory), vocab_size=kw["vocab_size"], max_chars=kw["max_chars"])
        return tokenizers.build(tok)
