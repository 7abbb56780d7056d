"""A small reader and writer of the safetensors format, without torch or the ``safetensors`` package.

A file is an 8-byte little-endian header length N, N bytes of JSON (``{name: {"dtype": "F32", "shape": [..],
"data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to the end of the header), then the
tensors' raw little-endian bytes. :class:`Reader` maps the file and hands out one tensor at a time (a view of the
mapping, read from disk when touched), so a converter holds one tensor in host memory beside what it builds;
:func:`write` writes tensors one after another from a list of (name, producer) without holding them all.
A sharded checkpoint (``model.safetensors.index.json`` with its ``weight_map``) reads as one :class:`Folder`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from longctx.convert.errors import ConvertError

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # the format's own bound on the header


class Reader:
    """The tensors of one ``.safetensors`` file: ``names()``, ``shape(name)``, ``dtype(name)``, ``get(name)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ConvertError(f"{self.path} is not a safetensors file (shorter than its 8-byte header length)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER:
                    raise ConvertError(f"{self.path} is not a safetensors file (header length {n} is too large)")
                raw = f.read(n)
        except OSError as e:
            raise ConvertError(f"cannot read {self.path} ({e.strerror or e})") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ConvertError(f"{self.path} is not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise ConvertError(f"{self.path} is not a safetensors file (its header is not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.start = 8 + n
        size = self.path.stat().st_size - self.start
        self.entries = {}
        for name, e in header.items():
            try:
                dtype, shape, (b, end) = DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ConvertError(f"{self.path}: tensor {name!r} has an unreadable header entry "
                                   f"(dtype one of {', '.join(DTYPES)}, shape, data_offsets)") from None
            if not (0 <= b <= end <= size) or end - b != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise ConvertError(f"{self.path}: tensor {name!r} ({e['dtype']}{list(shape)}) has data offsets "
                                   f"{[b, end]} that do not fit its size or the file; the file is truncated or corrupt")
            self.entries[name] = (dtype, shape, b)
        self._map = None

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only view of the file's mapping."""
        dtype, shape, b = self.entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=self.start + b).reshape(shape)


class Folder:
    """Every ``*.safetensors`` file of a Hugging Face folder as one name -> tensor table: the files named by
    ``model.safetensors.index.json``'s ``weight_map`` when it exists, else every ``*.safetensors`` file."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise ConvertError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from None
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise ConvertError(f"{index} names shard {missing[0]}, which is not in {folder}")
            paths = [folder / f for f in files]
        else:
            paths = sorted(folder.glob("*.safetensors"))
        if not paths:
            raise ConvertError(f"no *.safetensors file in {folder} (a PyTorch .bin checkpoint is not read; save it "
                               "with safe_serialization=True)")
        self.readers = [Reader(p) for p in paths]
        self.where = {}  # name -> (reader, the name stored in its file)
        for r in self.readers:
            for name in r.names():
                self.where.setdefault(name, (r, name))

    def names(self) -> list[str]:
        return list(self.where)

    def rename(self, names: dict) -> None:
        """Read each tensor under a new name: ``names`` maps a current name to the new one."""
        self.where = {names.get(n, n): v for n, v in self.where.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        r, stored = self.where[name]
        return r.shape(stored)

    def get(self, name: str) -> np.ndarray:
        r, stored = self.where[name]
        return r.get(stored)


def write(path: str | Path, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
          metadata: dict | None = None) -> None:
    """Write a ``.safetensors`` file of ``tensors``: (name, shape, dtype, a function that returns the array), each
    produced and written in turn. The header is padded with spaces to a multiple of 8 bytes (as the reference
    writer does)."""
    items = list(tensors)
    header, offset = {}, 0
    for name, shape, dtype, _ in items:
        dtype = np.dtype(dtype)
        n = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": NAMES[dtype], "shape": [int(s) for s in shape], "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype, make in items:
            a = np.ascontiguousarray(make(), dtype=np.dtype(dtype))
            if a.shape != tuple(shape):
                raise ValueError(f"tensor {name}: produced {a.shape}, declared {tuple(shape)}")
            f.write(a.tobytes())  # the DTYPES are little-endian, as is every platform JAX runs on
