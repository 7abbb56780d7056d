"""enwik8: the first 10^8 bytes of the English Wikipedia XML dump of 2006-03-03.

``data.path`` is ``enwik8.zip`` (single member ``enwik8``), the unzipped ``enwik8``
file, or a folder holding either (the zip is preferred when both are there).

Checks (``data.options.verify=True``, the default):

* zip: 36,445,475 bytes with sha256 ``547994d9…34bc``; its one member ``enwik8`` has 10^8 bytes.
* unzipped file: 10^8 bytes, starts with ``<mediawiki ``, and holds exactly 205 distinct byte
  values (no checksum of the unzipped file is published with the dataset).
* always (even with verify off): the zip's CRC-32, so a corrupt or truncated zip is an error,
  never a half-read split.

Splits (the awd-lstm / Transformer-XL / Transformer-VQ convention): with n bytes and
k = n // 20, train = [0, n - 2k), valid = [n - 2k, n - k), test = [n - k, n). For the real
file (n = 10^8, k = 5,000,000) that is exactly 90M / 5M / 5M. Other sizes are accepted only
with ``data.options.verify=False`` (test fixtures), using the same formula.

Vocabulary: bytes (``data.tokenizer='bytes'``); each split is one document and every byte is
scored. ``data.options.txl_compat=True`` removes the newline bytes (0x0A) from each split after
the split (Transformer-XL's ``add_eos=False`` convention: newlines are never predicted or
counted), which changes the number of scored bytes; report N with bpc.
"""

from __future__ import annotations

import hashlib
import zipfile
import zlib
from pathlib import Path

import numpy as np

from longctx.data.dsutil import data_path, option, sha256_file
from longctx.errors import DataError

URL = "http://mattmahoney.net/dc/enwik8.zip"
ZIP_BYTES = 36_445_475
ZIP_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
NUM_BYTES = 100_000_000
DISTINCT_BYTES = 205
HEADER = b"<mediawiki "
MEMBER = "enwik8"

WHERE = (f"enwik8 is the zip {URL} (Matt Mahoney's Large Text Compression Benchmark; "
         f"{ZIP_BYTES:,} bytes, sha256 {ZIP_SHA256}) holding one member 'enwik8' of {NUM_BYTES:,} bytes")


def split_bounds(n: int) -> dict[str, tuple[int, int]]:
    """Byte ranges of the splits: the last 10% is cut into valid (5%) and test (5%)."""
    k = n // 20
    return {"train": (0, n - 2 * k), "valid": (n - 2 * k, n - k), "test": (n - k, n)}


def locate(path: str) -> tuple[Path, str]:
    """(file, 'zip' | 'raw') for data.path."""
    if not path:
        raise DataError(f"enwik8: set data.path to enwik8.zip, the unzipped enwik8 or their folder. {WHERE}")
    p = Path(path).expanduser()
    if p.is_dir():
        for name, kind in (("enwik8.zip", "zip"), ("enwik8", "raw")):
            if (p / name).is_file():
                return p / name, kind
        raise DataError(f"enwik8: expected {p / 'enwik8.zip'} or {p / 'enwik8'}, found neither. {WHERE}")
    if not p.is_file():
        raise DataError(f"enwik8: expected the file {p} (enwik8.zip or enwik8), it does not exist. {WHERE}")
    with open(p, "rb") as f:
        magic = f.read(4)
    # a truncated zip has no central directory (is_zipfile() is False): judge by name and magic
    is_zip = p.suffix.lower() == ".zip" or magic == b"PK\x03\x04" or zipfile.is_zipfile(p)
    return p, ("zip" if is_zip else "raw")


def read_zip(path: Path) -> bytes:
    """The member 'enwik8', read whole with its CRC-32 checked."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if names != [MEMBER]:
                raise DataError(f"enwik8: {path} should hold exactly one member 'enwik8', it holds {names[:5]}. {WHERE}")
            with zf.open(MEMBER) as f:
                data = f.read()  # raises BadZipFile on a CRC mismatch
            if len(data) != zf.getinfo(MEMBER).file_size:
                raise DataError(f"enwik8: {path} is truncated: read {len(data):,} of {zf.getinfo(MEMBER).file_size:,} bytes. {WHERE}")
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise DataError(f"enwik8: {path} is corrupt or truncated ({e}); download it again. {WHERE}") from None
    return data


class Enwik8Source:
    name = "enwik8"
    splits = ("train", "valid", "test")
    default_tokenizer = "bytes"
    single_document = True  # each split is one stream of bytes (data.packing='auto' trains 'document' rows)

    def __init__(self, data_cfg=None, path: str | None = None, *, verify: bool | None = None, txl_compat: bool | None = None):
        self.file, self.kind = locate(path if path is not None else data_path(data_cfg))
        self.verify = option(data_cfg, "verify", True) if verify is None else verify
        self.txl_compat = option(data_cfg, "txl_compat", False) if txl_compat is None else txl_compat
        self._data: bytes | None = None
        self._file_sha256: str | None = None

    def _check_file(self) -> None:
        size = self.file.stat().st_size
        if self.kind == "zip":
            if size != ZIP_BYTES:
                raise DataError(f"enwik8: {self.file} has {size:,} bytes, expected {ZIP_BYTES:,} (truncated or a different "
                                f"file; set data.options.verify=False only for test fixtures). {WHERE}")
            self._file_sha256 = sha256_file(self.file)
            if self._file_sha256 != ZIP_SHA256:
                raise DataError(f"enwik8: {self.file} has sha256 {self._file_sha256}, expected {ZIP_SHA256}; download it again. {WHERE}")
        elif size != NUM_BYTES:
            raise DataError(f"enwik8: {self.file} has {size:,} bytes, expected {NUM_BYTES:,} (set data.options.verify=False "
                            f"only for test fixtures). {WHERE}")

    def data(self) -> bytes:
        if self._data is None:
            if self.verify:
                self._check_file()
            data = read_zip(self.file) if self.kind == "zip" else self.file.read_bytes()
            if self.verify:
                if len(data) != NUM_BYTES:
                    raise DataError(f"enwik8: {self.file} holds {len(data):,} bytes, expected {NUM_BYTES:,}. {WHERE}")
                if self.kind == "raw":
                    distinct = int(np.count_nonzero(np.bincount(np.frombuffer(data, np.uint8), minlength=256)))
                    if not data.startswith(HEADER) or distinct != DISTINCT_BYTES:
                        raise DataError(f"enwik8: {self.file} has the right size but is not enwik8 (header {data[:11]!r}, "
                                        f"{distinct} distinct byte values, expected {HEADER!r} and {DISTINCT_BYTES}). {WHERE}")
            self._data = data
        return self._data

    def split_bytes(self, split: str) -> bytes:
        if split not in self.splits:
            raise DataError(f"enwik8: unknown split {split!r}; splits: {', '.join(self.splits)}")
        a, b = split_bounds(len(self.data()))[split]
        out = self.data()[a:b]
        return out.replace(b"\n", b"") if self.txl_compat else out

    def metadata(self) -> dict:
        data = self.data()
        n = len(data)
        if self.kind == "zip":
            self._file_sha256 = self._file_sha256 or sha256_file(self.file)
            content = self._file_sha256
        else:
            content = hashlib.sha256(data).hexdigest()
        bounds = split_bounds(n)
        newlines = {s: data[a:b].count(b"\n") for s, (a, b) in bounds.items()}
        scored = {s: (b - a) - (newlines[s] if self.txl_compat else 0) for s, (a, b) in bounds.items()}
        key = f"enwik8|{content}|txl_compat={bool(self.txl_compat)}"
        return {
            "source": self.name,
            "file": str(self.file),
            "kind": self.kind,
            "verified": bool(self.verify),
            "standard": n == NUM_BYTES,
            "file_sha256": content,
            "byte_count": n,
            "split_bounds": {s: list(v) for s, v in bounds.items()},
            "txl_compat": bool(self.txl_compat),
            "newline_bytes": newlines,
            "scored_bytes": scored,
            "protocol_note": ("Transformer-XL convention: newline bytes removed, never scored" if self.txl_compat
                              else "every byte scored, newlines included"),
            "content_hash": hashlib.sha256(key.encode()).hexdigest(),
        }

    def documents(self, split: str):
        yield f"enwik8.{split}", self.split_bytes(split)
